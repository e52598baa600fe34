"""Attention whose features hold the heads innermost: ``q.view(B, T, head_dim, heads)``,
permuted to (B, heads, T, head_dim) for SDPA, and the output merged back the same way
(``permute(0, 2, 3, 1).reshape(B, T, head_dim * heads)``). The view was read as
(heads, head_dim) with head_dim as the heads: q, k and v were sharded along head_dim and
all-gathered before attention, and the merge reached o as a (batch, heads) merge, cut
back to each rank's block (zoo 20 Z8: 8 redistributions a block pair). Now the view's
parts (head_dim) end as the dim attention contracts, so the shard is on the heads inside
every part (``fused [heads] x head_dim``, as for packed q|k|v parts), and the row linear
after the merge takes the same layout along its input features
(analysis/sharding/strided.py ``strided_features``, decision 223).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.plan.layouts import Fused
from tp_check import plan_and_check

D, HEADS = 32, 4
HD = D // HEADS


class InnerHeads(nn.Module):
    def __init__(self, o=None):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.o = o if o is not None else nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HD, HEADS).permute(0, 3, 1, 2) for m in (self.q, self.k,
                                                                             self.v))
        a = F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True)
        return x + self.o(a.permute(0, 2, 3, 1).reshape(b, t, D))


class OuterHeads(InnerHeads):
    """The usual (heads, head_dim) order, sharing InnerHeads' o."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, HD).transpose(1, 2) for m in (self.q, self.k,
                                                                        self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.o(a.transpose(1, 2).reshape(b, t, D))


def _batch():
    return (torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("tp", [2, 4])
def test_heads_inner_attention_is_sharded_by_heads_with_no_redistribution(tp):
    torch.manual_seed(0)
    d = plan_and_check(nn.Sequential(InnerHeads(), InnerHeads()), _batch(), tp)
    inner = Fused((HEADS,) * HD)
    for i in range(2):
        assert {f"{i}.q.weight", f"{i}.k.weight", f"{i}.v.weight"} <= d.column
        assert f"{i}.o.weight" in d.row
        for m in "qkvo":
            assert d.layouts[f"{i}.{m}.weight"] == inner, (m, d.layouts.get(f"{i}.{m}.weight"))
    assert d.dims["0.o.weight"] == 1
    assert d.redistributions == [], d.redistributions
    assert f"layout fused [{HEADS}] x {HD}: 0.o.weight" in d.report


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def test_a_row_read_heads_inner_and_heads_outer_is_not_cut_two_ways():
    """One o for both orders: its input dim cannot be laid out both ways, so the attention
    it joins stays whole, named, while the MLP is sharded, and what the ranks compute
    still equals the model."""
    torch.manual_seed(0)
    shared = nn.Linear(D, D)
    d = plan_and_check(nn.Sequential(InnerHeads(shared), OuterHeads(shared), MLP()),
                       _batch(), 2)
    assert not {w for w in d.column | d.row if w.endswith(".o.weight")}, d.row
    assert {"2.up.weight", "2.down.weight"} <= d.column | d.row
    assert any(re.search(r"\d\.o\.weight's input is read both as an evenly split tensor and "
                         r"as a fused tensor", line) for line in d.report), d.report
