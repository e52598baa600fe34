"""Where a column's walk ends at a norm (planning/tp_seeds.py ``_whole_features``).

A norm over a part of a fused output taken whole (x-transformers' GRU-gated residual: ``r, z =
sigmoid(gates(cat[x, y])).chunk(2)`` mixes the stream, then the MLP's pre-LayerNorm reads it)
normalises fewer features than the fused column outputs, so the walk took it for a per-head
norm and went on through it: ``gates`` paired with the MLP's ``ff_in`` as a row, and
``ff_out``, left without a column, stayed whole (a held-out zoo, 3 of 5 matrices). A per-head
norm reads the heads split out into a dim of their own; a norm over a value of the column's
own rank ends the pair as a block's input norm does: gates | cand and ff_in | ff_out pair.
Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check

D, FF = 32, 64


class GatedResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin_y = nn.Linear(D, D)
        self.gates = nn.Linear(2 * D, 2 * D)
        self.cand = nn.Linear(D, D, bias=False)
        self.norm = nn.LayerNorm(D)
        self.ff_in, self.ff_out = nn.Linear(D, 2 * FF), nn.Linear(FF, D)

    def forward(self, x):
        y = self.lin_y(x)
        r, z = torch.sigmoid(self.gates(torch.cat([x, y], -1))).chunk(2, -1)
        x = (1 - z) * x + z * torch.tanh(self.cand(r * x) + y)
        h, g = self.ff_in(self.norm(x)).chunk(2, -1)
        return x + self.ff_out(h * F.gelu(g))


class QKNormAttention(nn.Module):
    """q and k normed per head after the heads split (OLMo-2/Qwen3 style), fused qkv."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.qn, self.kn = nn.LayerNorm(D // heads), nn.LayerNorm(D // heads)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p.view(b, t, self.heads, -1) for p in self.qkv(x).chunk(3, -1))
        q, k = self.qn(q), self.kn(k)
        a = F.scaled_dot_product_attention(*(p.transpose(1, 2) for p in (q, k, v)), is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, D))


def _batch():
    return (torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_norm_over_a_fused_part_taken_whole_ends_the_pair(tp):
    torch.manual_seed(0)
    d = plan_and_check(GatedResidualBlock(), _batch(), tp)
    assert d.column == {"gates.weight", "ff_in.weight"}, d.report
    assert d.row == {"cand.weight", "ff_out.weight"}, d.report


def test_a_per_head_norm_stays_inside_the_pair():
    torch.manual_seed(0)
    d = plan_and_check(QKNormAttention(), _batch(), 2)
    assert d.column == {"qkv.weight"} and d.row == {"o.weight"}, d.report
