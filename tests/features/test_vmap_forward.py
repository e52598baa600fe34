"""``torch.vmap`` in forward (s5-pytorch's S5Block vmaps its state-space scan over the batch,
zoo 25 F3). torch.export writes it as a level entered, batch dims added and removed, the
level left; the entry and exit have no users, so dead code elimination dropped them and
block outlining hoisted them out of their block: the program failed at any tp ("your tensor
may have escaped from inside a function being vmapped"), reported as an internal error. At
tp 2 the sequence-parallel gather went inside the level, where an autograd Function cannot
run; a linear inside it was sharded the same way. And the failed check left the level
entered, so the model's own reference step then failed ("called random operation while in
randomness error mode") and the model was blamed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec
from parallelizer.frontend.vmap_regions import ENTER, levels_restored

D = 16


class ScanBlock(nn.Module):
    """A per-sample scan over time, vmapped over the batch, between a norm and an MLP."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.decay = nn.Parameter(torch.linspace(0.5, 0.9, D))
        # complex, as S5's Lambda: the self-check compared its gradient with an in-place
        # abs_, which complex tensors refuse
        self.rot = nn.Parameter(torch.polar(torch.ones(D), torch.linspace(0.0, 0.3, D)))

    def scan(self, s):  # (T, D): one sample
        steps = torch.arange(s.shape[0], dtype=s.dtype)[:, None]
        h = torch.cumsum(s * self.decay ** -steps, 0) * self.decay ** steps
        return (h * self.rot).real

    def forward(self, x):
        h = torch.vmap(self.scan)(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(h)))


class InnerMLP(nn.Module):
    """The MLP itself applied per sample under vmap."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + torch.vmap(lambda h: self.fc2(F.gelu(self.fc1(h))))(self.norm(x))


class Net(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.emb = nn.Embedding(32, D)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(D, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _compile(block, tp):
    torch.manual_seed(0)
    ids = (torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1)),)
    return compiler.compile_module(Net(block), ids, Spec.model_validate({"mesh": {"tp": tp}}))


def _role(program, fqn: str) -> str:
    return program.plan.tensors[fqn].role


def _self_check(program) -> str:
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    return note


@pytest.mark.parametrize("tp", [1, 2])
def test_a_vmapped_scan_compiles_and_its_ranks_match_the_model(tp):
    program = _compile(ScanBlock, tp)
    if tp == 2:  # the pairs around the scan are sharded; the gather before it stays outside
        assert _role(program, "blocks.1.fc1.weight") == "column_parallel"
        assert _role(program, "blocks.1.fc2.weight") == "row_parallel"
        assert "sequence parallel: on" in "\n".join(program.notes), program.notes
        assert "self-check: 2 tp rank(s) of the program against the model" in \
            _self_check(program)


def test_linears_inside_vmap_stay_whole_naming_why():
    program = _compile(InnerMLP, 2)
    assert _role(program, "blocks.0.fc1.weight") == "replicate"
    assert any("it runs inside torch.vmap (at test_vmap_forward.py:" in line
               and "where tp's operators (autograd Functions) cannot run" in line
               for line in program.report.splitlines()), program.report
    assert "self-check: 2 tp rank(s)" in _self_check(program)


def test_a_failing_run_leaves_no_vmap_level_entered():
    with pytest.raises(RuntimeError, match="stop"):
        with levels_restored():
            ENTER(4, "error")
            raise RuntimeError("stop")
    assert torch._C._functorch.maybe_current_level() is None
    torch.randn(2)  # outside any level: random ops run
