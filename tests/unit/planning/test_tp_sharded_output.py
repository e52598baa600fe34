"""The model's output sharded by the plan: a column linear's output (a gate, sharded along
its features) also scales the block's output, ``x + g * down(silu(g) * up(x))``, so the
residual sum each rank returns is its shard of the features (the residual stream cut to
meet it). No rule read the graph's output node, so nothing gathered it: at tp2 each rank
returned (B, T, H / 2) (the compile's numerics self-check, an internal error; DiT's
adaLN-Zero gate ``x + gate.unsqueeze(1) * mlp(..)`` before its seed walk stopped at the
conditioning broadcast). The output now reads it through an all-gather
(analysis/sharding/propagate.py ``_output``). Each rank equals the unmodified model
(outputs, every gradient, one SGD step; fp32, 1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H, x_batch


class GatedOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        g = self.gate(x)
        return x + g * self.down(F.silu(g) * self.up(x))


class TwoOutputs(GatedOut):
    def forward(self, x):
        g = self.gate(x)
        return g, x + g * self.down(F.silu(g) * self.up(x))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", [GatedOut, TwoOutputs])
def test_a_sharded_output_is_gathered(model, tp):
    torch.manual_seed(0)
    d = plan_and_check(model(), x_batch(), tp)
    assert {"gate.weight", "up.weight"} <= d.column and d.row == {"down.weight"}
    gathers = [r for r in d.redistributions if r.readers == ("output",)]
    assert gathers and all(r.kind == "all_gather" for r in gathers), d.redistributions
