"""A linear whose weight is computed in forward: from parameters, a low-rank factorisation
``F.linear(x, A @ B)`` or a LoRA update merged into it, ``F.linear(x, W + A @ B)`` (Hu et al.
2021, "LoRA", section 4.1); from an activation, a hypernetwork's weight (Ha et al. 2016,
"HyperNetworks", section 3.2) made by a linear the planner shards. The product ``A @ B`` is
read as a linear of B (as ``q(state)`` of a learned state is, block-recurrent-transformer's),
so the planner sharded B's columns, and the linear then read each rank's slice of the
weight's input features with the whole input: an internal error at the compile's rank check,
"a and b must have same reduction dim" (zoo 23 F1, F2). A linear of a computed weight now
takes every operand replicated, a sharded one gathered. Each rank equals the unmodified model
(outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, Hyper, MLPThen, x_batch

FFN, RANK = 64, 8


class LowRank(nn.Module):
    def __init__(self, merged: bool):
        super().__init__()
        self.a = nn.Parameter(torch.randn(FFN, RANK) * 0.3)
        self.b = nn.Parameter(torch.randn(RANK, H) * 0.3)
        self.w = nn.Parameter(torch.randn(FFN, H) * H ** -0.5) if merged else None

    def forward(self, x):
        w = self.a @ self.b
        return F.linear(x, w if self.w is None else self.w + w)


@pytest.mark.parametrize("merged", [False, True], ids=["a_at_b", "w_plus_a_at_b"])
def test_a_weight_computed_from_parameters_is_read_whole(merged):
    torch.manual_seed(0)
    model = MLPThen(LowRank(merged), FFN)
    gm, d = planned(model, x_batch(), 2)
    assert "fc1.weight" in d.column and "fc2.weight" in d.row, d.report
    # the weight is whole where the linear reads it: gathered when B's columns are sharded
    assert "layer.b" not in d.dims or any(
        r.kind == "all_gather" for r in d.redistributions), d.report
    assert_tp_matches(model, x_batch(), 2, d, gm)


def test_a_linear_of_a_sharded_computed_weight_gathers_it():
    torch.manual_seed(0)
    model = MLPThen(Hyper(), 4)
    gm, d = planned(model, x_batch(), 2)
    assert "fc1.weight" in d.column and "fc2.weight" in d.row, d.report
    assert "layer.make.weight" in d.column, d.report  # the weight it makes arrives sharded
    assert_tp_matches(model, x_batch(), 2, d, gm)
