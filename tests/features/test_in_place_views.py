"""In-place views (``x.unsqueeze_(2)``, ``transpose_``, ``squeeze_``): they change a tensor's
shape, not its values, and BigBird's block-sparse attention writes its context that way.
The planner read them as writes into a head-sharded input, which no gathered copy can
stand in for, and kept the whole attention replicated (a break test: 4 of 12 matrices at
tp2). Capture now spells each as its out-of-place view, read by every later reader of the
input (frontend/capture.py ``_VIEW_IN_PLACE``); the attention is sharded and each rank
equals the model (outputs, every gradient, one SGD step; fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H, captured, x_batch

HEADS = 4


class InPlaceViewAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, HEADS, -1) for m in (self.q, self.k, self.v))
        q.transpose_(1, 2)
        k.transpose_(1, 2)
        v = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).clone()  # backward reads SDPA's
        y.unsqueeze_(2)  # (B, heads, 1, T, D), as BigBird's first_context_layer
        y.squeeze_(2)
        y.transpose_(1, 2)
        return self.o(y.reshape(B, T, H))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleList(InPlaceViewAttention() for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(2))

    def forward(self, x):
        for norm, attn in zip(self.norms, self.attn):
            x = x + attn(norm(x))
        return x


def test_capture_spells_in_place_views_out_of_place():
    ops = {str(n.target) for n in captured(Net(), x_batch()).gm.graph.nodes}
    assert not {"aten.transpose_.default", "aten.unsqueeze_.default", "aten.squeeze_.dim"} & ops


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_written_with_in_place_views_is_sharded(tp):
    torch.manual_seed(0)
    d = plan_and_check(Net(), x_batch(), tp)
    for i in range(2):
        assert {f"attn.{i}.{m}.weight" for m in "qkv"} <= d.column and f"attn.{i}.o.weight" in d.row
