"""A module registered under two paths: Enformer's ``self._trunk = nn.Sequential(self.stem,
self.conv_tower, self.transformer, ...)`` is called through ``_trunk`` while its
parameters are named by their first path (``transformer.0...``). The planner found the
blocks by the parameters' names and the graph's nodes carried the called path, so the
stage check stopped with a raw traceback: "SplitMismatch: internal error: ... blocks () vs
planned ('transformer.0', 'transformer.1')" (zoo 12 F15). Capture now writes every module
path as ``named_modules()``'s first path for that module."""
import torch
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.ff(x)


class _Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.Sequential(_Block(), _Block())
        self._trunk = nn.Sequential(self.stem, self.blocks, self.head)

    def forward(self, x):
        return self._trunk(x)


def _compile(spec):
    torch.manual_seed(0)
    batch = (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1)),)
    return compiler.compile_module(_Trunk(), batch, Spec.model_validate(spec),
                                   lambda out, b: out.square().mean())


def test_blocks_called_through_a_second_path_are_planned_and_split():
    tp = _compile({"mesh": {"tp": 2}})
    assert tp.plan.tensors["blocks.0.ff.0.weight"].role == "column_parallel"
    pp = _compile({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    for program in (tp, pp):
        (note,) = [n for n in program.notes if n.startswith("self-check")]
        assert "max abs err" in note, note
