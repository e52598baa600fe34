"""A padding mask tiled over the heads and merged with the batch, then negated before it
meets the (batch x heads) merged scores: graph-transformer-pytorch writes
``mask = repeat(mask, 'b i j -> (b h) i j', h=h)`` (an expand and a merge view), then
``sim.masked_fill_(~mask, -max)``. The planner cuts such a mask to each rank's heads before
the merge (analysis/sharding/strided.py ``request_narrow``), but looked back from the fill
only through copies and same-shape views; the ``~`` stopped it, and every attention weight
was kept replicated (zoo 21: 4 of 16 matrices at tp2, 12 of 16 now, `--verify` PASS at tp2
and tp2 x pp2). An elementwise op of the mask alone is now looked through (decision 215)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tp_check import plan_and_check

D, HEADS = 32, 4


class MergedHeadsAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)

    def forward(self, x, mask):
        b, n, _ = x.shape
        k, v = self.kv(x).chunk(2, dim=-1)
        # 'b n (h d) -> (b h) n d'
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2).reshape(b * HEADS, n, -1)
                   for t in (self.q(x), k, v))
        sim = q @ k.transpose(1, 2) * (D // HEADS) ** -0.5
        pair = mask[:, :, None] & mask[:, None, :]
        tiled = pair[:, None].expand(b, HEADS, n, n).reshape(b * HEADS, n, n)
        sim.masked_fill_(~tiled, -torch.finfo(sim.dtype).max)
        y = (sim.softmax(dim=-1) @ v).view(b, HEADS, n, -1).transpose(1, 2).reshape(b, n, D)
        return self.out(y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MergedHeadsAttention() for _ in range(2))

    def forward(self, x, mask):
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_negated_mask_merged_with_the_batch_is_cut_to_the_rank_heads(tp):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    d = plan_and_check(Net(), (torch.randn(2, 6, D, generator=g), mask), tp)
    for i in range(2):
        assert {f"layers.{i}.q.weight", f"layers.{i}.kv.weight"} <= d.column
        assert f"layers.{i}.out.weight" in d.row
    assert d.narrows  # the (b, heads, n, n) mask before its merge, cut to the rank's heads
