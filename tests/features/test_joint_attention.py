"""Joint attention (MMDiT, Esser et al. 2024 §2.2; SD3 and Flux): each stream has its own
fused q|k|v projection, viewed into (3, heads, head_dim) parts, and the two streams' parts
are concatenated along the sequence before q, k and v are taken one by one. The planner
looked for the parts to be taken straight from the view; the cat hid them, the 3 parts were
read as 3 heads ("tp = 2 does not divide the 3 heads") and every joint-attention weight
stayed replicated (lucidrains' mmdit: 6 of 16 matrices at tp2 in a held-out zoo, 14 of 16
now, `--verify` PASS at tp2 and tp4). A cat along another dim keeps the parts apart
(analysis/sharding/layouts.py ``_parts_taken``, decision 212)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H

HEADS = 4


class JointAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_x, self.qkv_c = nn.Linear(H, 3 * H), nn.Linear(H, 3 * H)
        self.o_x, self.o_c = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x, c):
        n = x.shape[1]
        parts = [m(s).unflatten(-1, (3, HEADS, H // HEADS)).permute(2, 0, 3, 1, 4)
                 for m, s in ((self.qkv_x, x), (self.qkv_c, c))]
        q, k, v = torch.cat(parts, dim=3)  # (3, B, heads, N_x + N_c, head_dim): one sequence
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return x + self.o_x(a[:, :n]), c + self.o_c(a[:, n:])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(JointAttention() for _ in range(2))

    def forward(self, x, c):
        for block in self.blocks:
            x, c = block(x, c)
        return x, c


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, H, generator=g), torch.randn(2, 3, H, generator=g)


@pytest.mark.parametrize("tp", [2, 4])
def test_joint_attention_over_two_streams_is_sharded_by_heads(tp):
    torch.manual_seed(0)
    d = plan_and_check(Net(), _batch(), tp)
    for i in range(2):
        assert {f"blocks.{i}.qkv_x.weight", f"blocks.{i}.qkv_c.weight"} <= d.column
        assert {f"blocks.{i}.o_x.weight", f"blocks.{i}.o_c.weight"} <= d.row
        assert d.layouts[f"blocks.{i}.qkv_x.weight"].text() == f"fused [{H}, {H}, {H}]"
