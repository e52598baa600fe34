"""A per-head weight whose dims are permuted before it is viewed as the matrix (analysis/
linears.py ``Linear.perm``): TransformerLens stores ``W_Q`` as (heads, d_model, d_head) and
reads it as ``rearrange(W_Q, "h dm dh -> (h dh) dm")``, ``W_O`` (heads, d_head, d_model) as
``"h dh dm -> dm (h dh)"``; a zoo's HookedTransformer kept every attention weight replicated
(8 of 36 matrices sharded). They are column and row weights cut along the heads, as an
einsum's per-head weight is; the tp ranks in lockstep (tests/tp_lockstep.py) give the
model's outputs, every gradient and the parameters after one SGD step."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tp_check import plan_and_check


class _HookedStyleAttention(nn.Module):
    def __init__(self, d=32, h=4, dh=8, transpose=False):
        super().__init__()
        self.h, self.dh, self.transpose = h, dh, transpose
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.randn(h, d, dh) / d ** 0.5)
                                        for _ in range(3))
        self.W_O = nn.Parameter(torch.randn(h, dh, d) / (h * dh) ** 0.5)

    def _in(self, w):  # "h dm dh -> (h dh) dm"
        read = w.transpose(1, 2) if self.transpose else w.permute(0, 2, 1)
        return read.reshape(self.h * self.dh, -1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (F.linear(x, self._in(w)).view(b, s, self.h, self.dh).transpose(1, 2)
                   for w in (self.W_Q, self.W_K, self.W_V))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = z.transpose(1, 2).reshape(b, s, self.h * self.dh)
        return F.linear(z, self.W_O.permute(2, 0, 1).reshape(-1, self.h * self.dh))


class _Blocks(nn.Module):
    def __init__(self, transpose):
        super().__init__()
        self.layers = nn.ModuleList(_HookedStyleAttention(transpose=transpose) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_permuted_per_head_weights_shard_along_the_heads_and_match(transpose, tp):
    torch.manual_seed(0)
    model = _Blocks(transpose)
    d = plan_and_check(model, (torch.randn(2, 6, 32),), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + f"W_{n}" for n in "QKV"} <= d.column, (d.column, d.report)
        assert p + "W_O" in d.row, (d.row, d.report)
