"""Python numbers read from tensors of constants are folded at capture
(frontend/constant_scalars.py). token-shift-gpt shifts feature chunks along the sequence by
``(2 ** torch.arange(3)).tolist()`` with ``F.pad(x, (0, 0, amt, -amt))``: export records the
reads as ``aten.item`` (unbacked symbols), and the compile's check of the program on fake
tensors could not run a pad of unknown size, an internal error at every layout (zoo 18).
Folded, the model compiles at tp2 and pp2. A number read from a parameter (which trains) is
not a constant and is not folded."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec


class _TokenShift(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        *chunks, rest = h.chunk(4, dim=-1)
        amts = (2 ** torch.arange(3)).tolist()
        shifted = [F.pad(c, (0, 0, a, -a)) for c, a in zip(chunks, amts)]
        return x + self.down(torch.cat((*shifted, rest), dim=-1))


def _reads(gm) -> int:
    return sum(n.target is torch.ops.aten.item.default for n in gm.graph.nodes)


def test_reads_of_constants_are_folded():
    gm = capture(nn.Sequential(_TokenShift(), _TokenShift()), (torch.randn(2, 6, 8),),
                 Path(__file__)).gm
    assert _reads(gm) == 0
    pads = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.pad.default]
    assert pads[:3] == [[0, 0, 1, -1], [0, 0, 2, -2], [0, 0, 4, -4]], pads


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}])
def test_a_shift_by_constant_numbers_compiles(mesh):
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2}})
    compiler.compile_module(nn.Sequential(_TokenShift(), _TokenShift()), (torch.randn(4, 6, 8),),
                            spec, reference=False)


class _ReadsAParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.tensor(1.0))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.shift.item()


def test_a_number_read_from_a_parameter_is_not_folded():
    gm = capture(_ReadsAParameter(), (torch.randn(2, 6, 8),), Path(__file__)).gm
    assert _reads(gm) == 1
