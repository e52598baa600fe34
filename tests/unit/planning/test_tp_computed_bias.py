"""A bias computed in forward for a fused q|k|v (timm's EVA and BEiT attention:
``F.linear(x, qkv.weight, torch.cat((q_bias, zeros, v_bias)))``, k having no bias). The
linear was not taken as one (its bias is no parameter), so the projection stayed whole on
every rank (6 of 8 matrices at tp2), and the same model adding that bias after the product
(``x @ W.t() + bias``) cut the bias evenly, so q|k|v was split evenly and all-gathered
before its split: attention computed whole on every rank. Now the bias is cut by the column
linear's layout (redistribution ``scatter_pieces``: each rank's block of every part, or its
copy of a kv head), the q|k|v projection is column_parallel and attention runs on the rank's
heads; every rank equals the unmodified model (outputs, every gradient, one SGD step; fp32)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch


class EvaAttention(nn.Module):
    """timm's EVA: a zero k bias buffer between the q and v bias parameters; 4 heads."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.q_bias = nn.Parameter(torch.randn(H) * 0.1)
        self.register_buffer("k_bias", torch.zeros(H), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(H) * 0.1)
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.reshape(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, H))


class GqaAttention(nn.Module):
    """BEiT's ``zeros_like`` k bias on a fused q|k|v of 4 query and 2 kv heads cut by sizes;
    ``added``: the bias added after the product instead of handed to the linear."""

    def __init__(self, added=False):
        super().__init__()
        self.added, self.hd = added, H // 4
        self.qkv = nn.Linear(H, 8 * self.hd, bias=False)
        self.q_bias = nn.Parameter(torch.randn(H) * 0.1)
        self.v_bias = nn.Parameter(torch.randn(2 * self.hd) * 0.1)
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False),
                          self.v_bias))
        qkv = x @ self.qkv.weight.t() + bias if self.added else \
            F.linear(input=x, weight=self.qkv.weight, bias=bias)
        q, k, v = qkv.split([H, 2 * self.hd, 2 * self.hd], dim=-1)
        q = q.view(b, t, 4, self.hd).transpose(1, 2)
        k, v = (z.view(b, t, 2, self.hd).transpose(1, 2).repeat_interleave(2, dim=1)
                for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, H))


def _cuts(decision) -> list:
    return [(r.kind, r.runs) for r in decision.redistributions]


def test_eva_computed_bias_is_cut_by_the_fused_layout():
    torch.manual_seed(0)
    model = EvaAttention()
    gm, d = planned(model, x_batch(), 2)
    assert "qkv.weight" in d.column and "proj.weight" in d.row, d.report
    # rank 0: the first half of each of q, k and v (a bias split evenly would take q whole)
    pieces = ((0, 16), (32, 16), (64, 16)), ((16, 16), (48, 16), (80, 16))
    assert _cuts(d) == [("scatter_pieces", pieces)], d.redistributions
    assert all(p not in d.dims for p in ("q_bias", "v_bias")), d.dims  # whole gradients
    assert_tp_matches(model, x_batch(), 2, d, gm)


@pytest.mark.parametrize("added", [False, True], ids=["in_linear", "added"])
def test_gqa_computed_bias_gives_each_rank_its_kv_head_copy(added):
    torch.manual_seed(0)
    model = GqaAttention(added)
    gm, d = planned(model, x_batch(), 4)
    assert "qkv.weight" in d.column and "proj.weight" in d.row, d.report
    # 8 query-head features each; ranks 0 and 1 hold copies of kv head 0, 2 and 3 of head 1
    runs = tuple(((8 * r, 8), (32 + 8 * (r // 2), 8), (48 + 8 * (r // 2), 8)) for r in range(4))
    assert _cuts(d) == [("scatter_pieces", runs)], d.redistributions
    assert_tp_matches(model, x_batch(), 4, d, gm)
