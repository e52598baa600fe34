"""A 3-D parameter (E, in, out) read by ``bmm`` / ``matmul`` with an input of the same E is
E linears side by side (analysis/graph_facts.py ``_batched_site``): a dense mixture of
experts written with ``torch.bmm`` or ``einsum("end,edf->enf")`` has its up weight column
parallel along dim 2 and its down weight row parallel along dim 1, every expert split
inside (was: both replicated, "no tensor-parallel rule splits a weight this op reads").
Ranks in lockstep in one process: outputs, every gradient and one SGD step equal the
unmodified model's pieces (fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer.analysis.linears import linear_sites
from tp_check import assert_tp_matches, planned
from tp_small_models import captured

D, FF, E = 16, 32, 4


class DenseMoE(nn.Module):
    """Every token through every expert, weighted by a softmax router (soft mixture). ``how``
    spells the expert products: ``bmm``, ``einsum``, ``"linear-layout"`` (weights stored (E,
    out, in) as nn.Linear's, read ``w.transpose(1, 2)`` / ``w.mT``) or ``"weight-first"``
    (``einsum("edf,end->enf", w, x)``, ``bmm(w.transpose(1, 2), x.mT)``)."""

    def __init__(self, how: str = "bmm"):
        super().__init__()
        self.router = nn.Linear(D, E)
        stored = (E, FF, D) if how == "linear-layout" else (E, D, FF)
        self.w1 = nn.Parameter(0.1 * torch.randn(*stored))
        self.w2 = nn.Parameter(0.1 * torch.randn(E, stored[2], stored[1]))
        self.how = how

    def forward(self, x):
        b, t, _ = x.shape
        gate = self.router(x).softmax(-1).reshape(b * t, E).t().unsqueeze(-1)  # (E, N, 1)
        xs = x.reshape(1, b * t, D).expand(E, -1, -1)
        if self.how == "einsum":
            y = torch.einsum("enf,efd->end", F.gelu(torch.einsum("end,edf->enf", xs, self.w1)),
                             self.w2)
        elif self.how == "linear-layout":
            y = F.gelu(torch.bmm(xs, self.w1.transpose(1, 2))) @ self.w2.mT
        elif self.how == "weight-first":
            h = F.gelu(torch.einsum("edf,end->enf", self.w1, xs))
            y = torch.bmm(self.w2.transpose(1, 2), h.mT).mT
        else:
            y = torch.bmm(F.gelu(torch.bmm(xs, self.w1)), self.w2)
        return x + (y * gate).sum(0).reshape(b, t, D)


class SoftMoE(nn.Module):
    """Soft MoE's slots (Puigcerver et al. 2023, §2.1): tokens dispatched into (E, slots, D)
    by an einsum of two activations, the batched experts, combined back. A 2-D linear before
    the dispatch must not pair with the experts' up weight as its row (its features land on
    the slots): that left nothing sharded (a break test)."""

    def __init__(self):
        super().__init__()
        self.inp, self.phi = nn.Linear(D, D), nn.Linear(D, E * 2, bias=False)
        self.w1 = nn.Parameter(0.1 * torch.randn(E, D, FF))
        self.w2 = nn.Parameter(0.1 * torch.randn(E, FF, D))

    def forward(self, x):
        xt = self.inp(x).reshape(-1, D)
        logits = self.phi(xt).reshape(-1, E, 2)
        slots = torch.einsum("sec,sd->ecd", logits.softmax(0), xt)
        ys = torch.bmm(F.gelu(torch.bmm(slots, self.w1)), self.w2)
        return x + torch.einsum("sec,ecd->sd", logits.softmax(-1), ys).reshape(x.shape)


class Broadcast(nn.Module):
    """``x @ W`` with x (1, N, in) broadcast against W (E, in, out): no matched E, so no
    side-by-side linears."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(0.1 * torch.randn(E, D, FF))
        self.out = nn.Linear(FF, D)

    def forward(self, x):
        return self.out(torch.matmul(x.reshape(1, -1, D), self.w).mean(0)).reshape(x.shape)


def _x():
    return (torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("how, tp", [("bmm", 2), ("bmm", 4), ("einsum", 2), ("einsum", 4),
                                     ("weight-first", 2)])
def test_dense_experts_split_inside_every_expert(how, tp):
    torch.manual_seed(0)
    model = DenseMoE(how)
    gm, decision = planned(model, _x(), tp)
    assert decision.column == {"w1"} and decision.row == {"w2"}
    assert decision.dims["w1"] == 2 and decision.dims["w2"] == 1
    assert_tp_matches(model, _x(), tp, decision, gm)


def test_experts_stored_as_linear_weights_split_along_their_out_and_in_dims():
    """W (E, out, in) read transposed: the column shards dim 1 (its out features), the row
    dim 2 (was: both replicated, and the refusal named the router's linear)."""
    torch.manual_seed(0)
    model = DenseMoE("linear-layout")
    gm, decision = planned(model, _x(), 2)
    assert decision.column == {"w1"} and decision.row == {"w2"}
    assert decision.dims["w1"] == 1 and decision.dims["w2"] == 2
    assert_tp_matches(model, _x(), 2, decision, gm)


def test_soft_moe_experts_pair_with_each_other_only():
    torch.manual_seed(0)
    model = SoftMoE()
    gm, decision = planned(model, _x(), 2)
    assert "w1" in decision.column and "w2" in decision.row
    assert_tp_matches(model, _x(), 2, decision, gm)


class SharedExperts(nn.Module):
    """Two blocks reading one pair of expert weights."""

    def __init__(self):
        super().__init__()
        first = DenseMoE()
        second = DenseMoE()
        second.w1, second.w2 = first.w1, first.w2
        self.blocks = nn.ModuleList([first, second])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_weights_shared_by_two_blocks_are_counted_sharded():
    """The count line said "0 of 4 ... (0 % of parameters)" while report.md's table had both
    expert weights sharded (a break test): they are planned under the name the graph reads
    them by. The compile (which reads a shared weight under one name) checks the numbers."""
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    program = compiler.compile_module(SharedExperts(), _x(), Spec.model_validate(
        {"mesh": {"tp": 2}}), reference=False)
    line = next(n for n in program.notes if n.startswith("tensor parallel: "))
    assert line.startswith("tensor parallel: 2 of 4 weight matrices in blocks sharded (97 %"), line
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes)


def test_a_broadcast_batch_dim_is_no_batched_linear():
    gm = captured(Broadcast(), _x()).gm
    assert {s.weight for s in linear_sites(gm.graph)} == {"out.weight"}
