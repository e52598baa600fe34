"""A model that writes its own input in place (``x.mul_(2)``, ``mask.masked_fill_(..)``):
legal PyTorch, and the model reads the written value. Each eager run of the model during
the compile read the same batch, so the self-check's repeat run read the doubled input and
took the model for one drawing random numbers (exit 3, "internal error", at tp2 and pp2:
zoo 21 F3); and the program wrote its input in place, so under pp the microbatches, views
of one batch sharing its version counter, failed each other's backward. Every run now gets
its own copy of the batch (frontend/capture.py ``split_args``), and capture spells a write
into an input out of place (``_out_of_place``): the program never modifies the batch it is
given, and its readers read the written value (decision 217)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec
from tp_small_models import captured

D = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x, mask):
        x.mul_(2.0).clamp_(-1.5, 1.5)
        mask.masked_fill_(x[..., 0] > 1.0, False)
        for block in self.blocks:
            x = block(x) * mask[..., None]
        return x


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, D, generator=g), torch.rand(4, 6, generator=g) > 0.2


def test_capture_writes_no_model_input_in_place():
    x, mask = _batch()
    gm = captured(WritesItsInput(), (x, mask)).gm
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    written = [n for n in gm.graph.nodes if n.op == "call_function"
               and str(n.target).split(".")[-2].endswith("_") and n.args[0] in inputs]
    assert not written, written


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}])
def test_a_model_writing_its_input_compiles_checks_and_leaves_the_batch_as_it_was(mesh):
    torch.manual_seed(0)
    x, mask = _batch()
    before = (x.clone(), mask.clone())
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2}})
    program = compile_module(WritesItsInput(), (x, mask), spec, reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "of the program against the model" in note, note
    assert torch.equal(x, before[0]) and torch.equal(mask, before[1])
