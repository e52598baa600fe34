"""A parameter the forward writes in place under ``torch.no_grad()`` and then reads: a
max-norm constraint (``w.copy_(F.normalize(w, dim=1))``), BLIP's / ALBEF's learned
temperature (``self.temp.clamp_(0.001, 0.5)``). Eager reads the parameter itself after the
write, which carries gradient; the capture read the no_grad region's detached output, so
the parameter got no gradient (zoo 20 Z7: an internal error from the self-check at tp2,
and above its size bounds a program that never trained the weight). Under pipeline
parallelism each microbatch's forward would write it again before the earlier
microbatches' backward, which autograd refuses at run time (a hang): refused at compile."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.compiler import compile_module
from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec
from tp_small_models import line_of

D = 32


class Constrained(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.temp = nn.Parameter(torch.tensor(0.07))

    def forward(self, x):
        with torch.no_grad():
            self.up.weight.copy_(F.normalize(self.up.weight, dim=1) * 2.0)
            self.temp.clamp_(0.001, 0.05)  # the write the pp refusal names
        return x + self.down(F.gelu(self.up(x))) / self.temp * 0.07


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Constrained() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _x():
    return torch.randn(4, 8, D, generator=torch.Generator().manual_seed(1))


def test_a_parameter_written_under_no_grad_keeps_its_gradient():
    torch.manual_seed(0)
    model = Net()
    gm = capture(model, (_x(),), Path(__file__)).gm
    want_model = Net()
    want_model.load_state_dict(model.state_dict())
    want = torch.autograd.grad(want_model(_x()).sum(), list(want_model.parameters()))
    got = torch.autograd.grad(gm(_x())[0].sum(), list(gm.parameters()))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_it_compiles_at_tp2_and_passes_the_self_check():
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    program = compile_module(Net(), (_x(),), spec, reference=False)
    assert program.plan.tensors["blocks.0.up.weight"].tp_dim == 0


def test_it_is_refused_under_pipeline_parallelism_naming_the_line():
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    line = line_of(__file__, "self.up.weight.copy_(")
    with pytest.raises(PlanError, match=rf"mesh.pp=2: the model's forward writes parameter "
                                        rf"blocks.0.up.weight in place .* at "
                                        rf"test_parameter_constraints.py:{line}.*autograd"):
        compile_module(Net(), (_x(),), spec, reference=False)


class RenormedLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, D, max_norm=1.0)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return x


def test_an_embedding_renorm_is_not_refused_under_pipeline_parallelism():
    """Its renorm writes the rows the lookup reads, and the lookup's backward keeps none of
    their values: once per microbatch is the model's once per step (each row's renorm is
    idempotent). A held-out zoo's max_norm embedding PASSes ``--verify`` at pp2."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    program = compile_module(RenormedLookup(), (ids,), spec, reference=False)
    assert len(program.plan.stages) == 2
