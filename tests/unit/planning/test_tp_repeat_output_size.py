"""GQA spelled as diffusers' attention processors spell it (StableAudio, zoo 19 Y5):
``repeat_interleave(k, r, dim=1, output_size=k.shape[1] * r)``. The tp pass made the repeats
local but kept ``output_size`` at the global head count, and the compile's run of each rank's
program stopped with an internal error ("repeat_interleave: Invalid output_size, expected 4
but got 8"). ``output_size`` is now the rank's (analysis/sharding/relayout.py), at tp
dividing the kv heads (blocks) and above them (copies)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.analysis.graph_facts import aten
from tp_check import plan_and_check, planned

D, H, KV, HD = 32, 8, 2, 4


class _GQA(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, H * HD), nn.Linear(D, KV * HD), nn.Linear(D, KV * HD)
        self.o = nn.Linear(H * HD, D)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, H, HD).transpose(1, 2)
        k, v = (p(x).view(b, s, KV, HD).transpose(1, 2) for p in (self.k, self.v))
        r = H // KV
        k = torch.repeat_interleave(k, r, dim=1, output_size=k.shape[1] * r)
        v = torch.repeat_interleave(v, r, dim=1, output_size=v.shape[1] * r)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.o(y.transpose(1, 2).reshape(b, s, H * HD))


@pytest.mark.parametrize("tp", [2, 4])
def test_the_output_size_of_a_repeat_over_sharded_heads_is_the_ranks(tp):
    torch.manual_seed(0)
    x = (torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)),)
    d = plan_and_check(_GQA(), x, tp)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    gm, _ = planned(_GQA(), x, tp)
    sizes = [n.kwargs.get("output_size") for n in gm.graph.nodes
             if n.target is aten.repeat_interleave.self_int]
    assert sizes == [H // tp, H // tp]
