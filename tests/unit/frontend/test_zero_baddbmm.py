"""Attention scores started from zeros (``torch.baddbmm(torch.zeros(B * H, T, T), q, k^T,
beta=1, alpha=s)``, GPT-NeoX-Japanese): the zeros are sized by the global heads and had no
sharded rule beside head-sharded q and k, so attention (and its block's q|k|v and dense)
stayed replicated, 4 of 8 matrices at tp2 on a held-out zoo's model. Capture writes the
``s * bmm(q, k^T)`` it computes (frontend/einsum.py ``zero_baddbmm_as_bmm``); a baddbmm
adding a real bias (BLOOM's ALiBi) is left as it is.

Each rank equals the model: outputs, every gradient, one SGD step (fp32, 1e-5)."""
from __future__ import annotations

import torch
from torch import nn

from parallelizer.analysis.graph_facts import aten
from tp_check import plan_and_check
from tp_small_models import captured

D, H, T = 32, 4, 6


class ZerosAttention(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.qkv, self.dense = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(H, 1, T) * 0.1) if bias else None

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        q, k, v = (a.reshape(b * H, t, D // H) for a in (q, k, v))
        base = torch.zeros(b * H, t, t) if self.bias is None else \
            self.bias.expand(b, H, 1, t).reshape(b * H, 1, t)
        scores = torch.baddbmm(base, q, k.transpose(1, 2), beta=1.0, alpha=(D // H) ** -0.5)
        y = torch.bmm(scores.softmax(-1), v).view(b, H, t, D // H).transpose(1, 2)
        return x + self.dense(y.reshape(b, t, D))


def test_scores_from_zeros_are_a_bmm_and_attention_is_sharded():
    torch.manual_seed(0)
    d = plan_and_check(ZerosAttention(), (torch.randn(2, T, D),), 2)
    assert (d.column, d.row) == ({"qkv.weight"}, {"dense.weight"})


def test_a_baddbmm_adding_a_bias_is_left_as_it_is():
    torch.manual_seed(0)
    gm = captured(ZerosAttention(bias=True), (torch.randn(2, T, D),)).gm
    assert any(n.target is aten.baddbmm.default for n in gm.graph.nodes)
