"""A tensor the model allocates once and each block writes into in place (a scratch or kv
cache reset every call: ``scratch[:, :t] = block(h)``, Meta's Llama 3 reference once its
cache is reset per call as the compile's own refusal advises). Under pp the stage after the
first receives it as a leaf that requires grad (torch.distributed.pipelining), and the
first in-place write there failed: "a view of a leaf Variable that requires grad is being
used in an in-place operation", an internal error at compile (zoo 12 F9). The stage now
reads a clone of such an input; the compile's checks pass and the stage graph shows it."""
import torch
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h, scratch):
        scratch[:, : h.shape[1]] = self.lin(h)
        return h + scratch[:, : h.shape[1]].relu()


class _Scratch(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        scratch = torch.zeros(x.shape[0], 32, 16)
        for layer in self.layers:
            x = layer(x, scratch)
        return x


def test_a_received_tensor_written_in_place_is_cloned_by_its_stage():
    torch.manual_seed(0)
    batch = (torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_Scratch(), batch, Spec.model_validate(
        {"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}}), lambda out, b: out.square().mean())
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "max abs err 0," in note, note
    assert "clone" in program.sources["program/stage1.py"], program.sources["program/stage1.py"]
    assert "clone" not in program.sources["program/stage0.py"]
