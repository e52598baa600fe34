"""Our ``PipelineStage`` (runtime/pipeline_stage.py) under torch's own shape inference: an
integer input that a later stage uses as an index must not be uninitialised memory.

One process, a gloo group of one rank holding both stages of a real
``torch.distributed.pipelining`` schedule (looped BFS), so stage 1 gets its inputs through
torch's same-rank metadata path (``_forward_metadata_inference`` -> ``_to_tensor``).
"""
import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleLoopedBFS

from parallelizer.runtime.pipeline_stage import SplitBackwardPipelineStage

VOCAB = 1000


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)

    def forward(self, ids, labels):
        return self.emb(ids), labels  # the labels travel to the stage with the head


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x, labels):  # per-token loss: labels index the logits
        return F.cross_entropy(self.head(x).transpose(1, 2), labels, reduction="none")


@pytest.fixture
def one_rank_group(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # restored after the test
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_integer_input_used_as_index_in_a_later_stage(one_rank_group):
    torch.manual_seed(0)
    first, last = Embed(), Head()
    ids = torch.randint(0, VOCAB, (4, 6))
    labels = torch.randint(0, VOCAB, (4, 6))
    want = F.cross_entropy(last.head(first.emb(ids)).transpose(1, 2), labels, reduction="none")
    # fill the allocator's free blocks with huge values, which torch.empty would hand back
    # for the label tensors of the inference forward
    junk = [torch.full((2, 6), 2 ** 40, dtype=torch.long) for _ in range(64)]
    del junk
    stages = [SplitBackwardPipelineStage(m, i, 2, torch.device("cpu"))
              for i, m in enumerate((first, last))]
    losses = []
    schedule = ScheduleLoopedBFS(stages, n_microbatches=2, loss_fn=lambda out, _t: out.mean())
    schedule.step(ids, labels, target=torch.zeros(4), losses=losses)
    assert len(losses) == 2
    assert torch.allclose(torch.stack(losses), want.view(2, 2, 6).mean(dim=(1, 2)), atol=1e-6)


class ToComplex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # a complex activation carrying gradient crosses the stages
        return torch.view_as_complex(self.lin(x).unflatten(-1, (4, 2)))


class FromComplex(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, z):
        return self.lin(torch.view_as_real(z).flatten(-2))


def test_complex_activation_carries_gradient_across_stages(one_rank_group):
    """torch's shape inference (``TensorMeta.to_tensor``) sets requires_grad on floating-point
    inputs only: a complex stage input then had no gradient buffer and the first backward
    stopped ("backward metadata for this grad slot is None")."""
    torch.manual_seed(0)
    first, last = ToComplex(), FromComplex()
    x = torch.randn(4, 6, 8)
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    ref_last(ref_first(x)).pow(2).mean().backward()
    stages = [SplitBackwardPipelineStage(m, i, 2, torch.device("cpu"))
              for i, m in enumerate((first, last))]
    schedule = ScheduleLoopedBFS(stages, n_microbatches=2,
                                 loss_fn=lambda out, _t: out.pow(2).mean())
    schedule.step(x, target=torch.zeros(4))
    for got, want in ((first, ref_first), (last, ref_last)):
        for (n, p), q in zip(got.named_parameters(), want.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)  # the schedule scales by 1/2


def test_strided_input_gradient_is_reported_contiguous(one_rank_group):
    """ConvNeXt's second stage reads its input through ``permute(0, 2, 3, 1)`` (the
    downsampling LayerNorm over channels), so autograd returns a channels-last gradient for
    it. torch allocates the previous rank's gradient receive buffer with the strides the
    shape-inference backward reports; a channels-last buffer failed gloo's ``irecv`` ("input
    tensor has to be contiguous", the zoo's convnext at pp2). The reported metadata is the
    contiguous layout that ``get_bwd_send_ops`` sends."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[8, 16],
                                      depths=[1, 1], image_size=32, num_labels=4)
    model = transformers.ConvNextModel(cfg).train()
    first = nn.Sequential(model.embeddings, model.encoder.stages[0])
    last = model.encoder.stages[1]
    x = torch.randn(4, 3, 32, 32)
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    h = ref_first(x).detach().requires_grad_(True)
    ref_last(h).pow(2).mean().backward()
    assert not h.grad.is_contiguous()  # the case: a strided input gradient
    ref_last.zero_grad()
    ref_last(ref_first(x)).pow(2).mean().backward()
    stages = [SplitBackwardPipelineStage(m, i, 2, torch.device("cpu"))
              for i, m in enumerate((first, last))]
    schedule = ScheduleLoopedBFS(stages, n_microbatches=2,
                                 loss_fn=lambda out, _t: out.pow(2).mean())
    schedule.step(x, target=torch.zeros(4))
    (meta,) = stages[1]._stage_meta.input_grads
    assert meta.stride == torch.empty(meta.shape).stride()
    for got, want in ((first, ref_first), (last, ref_last)):
        for (n, p), q in zip(got.named_parameters(), want.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)


class RunningMean(nn.Module):
    """A buffer the forward writes (a running mean, as BatchNorm's statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("rm", torch.zeros(8))

    def forward(self, x):
        h = self.lin(x)
        self.rm.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h - self.rm


def test_shape_inference_leaves_the_buffers_the_forward_writes(one_rank_group):
    """torch's shape inference is a real forward of each stage: it wrote the running means
    once more than the model before the first step (zoo 22 F2), so the pipelined losses
    and buffers matched no run of the model. Both stages now start from the model's."""
    torch.manual_seed(0)
    first, last = RunningMean(), RunningMean()
    x = torch.randn(4, 8)
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    want = [ref_last(ref_first(chunk)).pow(2).mean() for chunk in x.chunk(2)]
    stages = [SplitBackwardPipelineStage(m, i, 2, torch.device("cpu"))
              for i, m in enumerate((first, last))]
    losses = []
    schedule = ScheduleLoopedBFS(stages, n_microbatches=2,
                                 loss_fn=lambda out, _t: out.pow(2).mean())
    schedule.step(x, target=torch.zeros(4), losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), rtol=0, atol=0)
    torch.testing.assert_close(first.rm, ref_first.rm, rtol=0, atol=0)
    torch.testing.assert_close(last.rm, ref_last.rm, rtol=0, atol=0)
