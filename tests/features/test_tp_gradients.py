"""Gradient placements derived (analysis/gradients.py, planning/gradients.py): the dual of
sharding propagation on hand-built graphs and on standard blocks, and the fix it implies —
Partial parameters summed over tp (plan.grad_sync ``partial_tp``), an f on a replicated
activation entering sharded compute, an f on the sharded reads of a parameter that would
be Mixed — checked against the unmodified model with the tp ranks in lockstep
(tests/tp_lockstep.py: gradients and one SGD step, fp32, 1e-5).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten

from parallelizer.analysis.gradient_forward import PlannedForward
from parallelizer.analysis.gradients import Mixed, derive
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime.tp import copy_to_tp_region
from tp_lockstep import local, run_ranks
from tp_small_models import H, captured, x_batch

TOL = dict(rtol=1e-5, atol=1e-5)


class HeadNormAttention(nn.Module):
    """Attention with an RMSNorm over head_dim on q and k (Qwen3's q_norm / k_norm): its
    weight (head_dim,) multiplies the rank's heads only."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads, self.hd = heads, H // heads
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.q_norm = nn.Parameter(torch.rand(self.hd) + 0.5)
        self.k_norm = nn.Parameter(torch.rand(self.hd) + 0.5)

    def _norm(self, t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        b, s, _ = x.shape
        q = self._norm(self.q(x).view(b, s, self.heads, self.hd), self.q_norm).transpose(1, 2)
        k = self._norm(self.k(x).view(b, s, self.heads, self.hd), self.k_norm).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, H))


class ScaledMLP(nn.Module):
    """A scalar parameter broadcast over the sharded hidden dim (Partial), and a gate of one
    output feature (kept replicated: a replicated activation entering sharded compute)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 64), nn.Linear(64, H)
        self.gate = nn.Linear(H, 1)
        self.alpha = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = F.gelu(self.up(x)) * self.alpha * torch.sigmoid(self.gate(x))
        return self.down(h)


class SharedScale(nn.Module):
    """One scalar read both whole (on the replicated residual) and by sharded compute: its
    gradient would be Mixed; the sharded read gets an f instead."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 64), nn.Linear(64, H)
        self.alpha = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return x * self.alpha + self.down(F.gelu(self.up(x)) * self.alpha)


def _plan(model, tp=2):
    cap = captured(model, x_batch())
    return cap, plan_tp(cap.gm.graph, tp)


def _flow(cap, d):
    return derive(cap.gm.graph, PlannedForward(cap.gm.graph, d))


def _lockstep_matches(model, cap, d, tp=2):
    """Every rank's gradients and SGD step equal the unmodified model's pieces."""
    gm = copy.deepcopy(cap.gm)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    batch = x_batch(3, 6, seed=1)
    ref = copy.deepcopy(model)
    outs, _ = tree_flatten(ref(*batch))
    w = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(3))
    (outs[0] * w).sum().backward()
    ranks = run_ranks(gm, d, tp, list(batch), lambda o: (o[0] * w).sum(), 0.1)
    for r, res in enumerate(ranks):
        for fqn, p in ref.named_parameters():
            want = local(p.grad, fqn, d, tp, r)
            torch.testing.assert_close(res.grads[fqn], want, **TOL, msg=lambda m: f"{fqn}: {m}")
    return gm


def test_per_head_norm_weight_gradient_is_partial():
    """Qwen3's q_norm/k_norm: a (head_dim,) weight applied to head-sharded q/k has a Partial
    gradient (each rank sees its heads); the plan sums it over tp, nothing else changes."""
    model = HeadNormAttention()
    cap, d = _plan(model)
    flow = _flow(cap, d)
    assert flow.placement("q_norm", None) == Partial()
    assert flow.placement("k_norm", None) == Partial()
    assert flow.placement("q.weight", 0) == Shard(0) and flow.placement("o.weight", 1) == Shard(1)
    assert sorted(d.partial) == ["k_norm", "q_norm"] and d.f_edges == {}
    assert "test_tp_gradients.py" in d.partial["q_norm"]  # the op's source line
    assert any(line.startswith("gradient summed over tp once per step") for line in d.report)
    _lockstep_matches(model, cap, d)


@pytest.mark.parametrize("tp", [2, 4])
def test_scalar_broadcast_partial_and_gate_activation_gets_f(tp):
    model = ScaledMLP()
    cap, d = _plan(model, tp)
    assert d.column == {"up.weight"} and d.row == {"down.weight"}
    assert list(d.partial) == ["alpha"]
    (producer, readers), = d.f_edges.items()
    gm = _lockstep_matches(model, cap, d, tp)
    fs = [n for n in gm.graph.nodes if n.target is copy_to_tp_region]
    assert len(fs) == 2 and producer in {f.args[0].name for f in fs}  # up's input, the gate


def test_mixed_parameter_gets_f_on_its_sharded_read():
    model = SharedScale()
    cap, d = _plan(model)
    assert d.partial == {} and len(d.f_edges) == 1
    fwd = PlannedForward(cap.gm.graph, d)
    edges = frozenset((p, r) for p, readers in d.f_edges.items() for r in readers)
    assert edges == {("alpha", "mul_1")}  # alpha's read by the sharded gelu(up(x))
    assert derive(cap.gm.graph, fwd, forced=edges).placement("alpha", None) == Replicate()
    # without that f the same analysis finds the gradient Mixed
    assert derive(cap.gm.graph, fwd).placement("alpha", None) == Mixed()
    _lockstep_matches(model, cap, d)


@pytest.mark.parametrize("family", ["example_llama", "gpt2", "roberta"])
def test_standard_blocks_need_no_extra_sync(family):
    """Llama, GPT-2 and BERT (RoBERTa) blocks: every gradient is whole as Megatron's f/g
    leave it (Replicate or the parameter's Shard), so no f and no sum is added."""
    from tp_zoo_models import EXAMPLES, ZOO
    model, batch_of, _ = {**ZOO, **EXAMPLES}[family]()
    model.train()
    from parallelizer.frontend.capture import capture
    cap = capture(model, batch_of(), Path(family))
    d = plan_tp(cap.gm.graph, 2)
    assert d.partial == {} and d.f_edges == {}
    flow = _flow(cap, d)
    for target in flow.params:
        assert flow.placement(target, d.dims.get(target)) == (
            Replicate() if target not in d.dims else Shard(d.dims[target])), target
