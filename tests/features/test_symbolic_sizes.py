"""A head merge sized by an expression the graph computes at run time (issue 23: "a
per-rank shape mismatch is a compile-time error", and no wrong program): after the
Hourglass transformer's upsampling ``up(short).reshape(B, T, D)``, export spells the next
attention's ``C = x.shape[-1]`` as ``128 * (T // 2) // T``. The tp pass halved the heads
of the split view and left the merge view ``view(B, T, C)`` at the global C: the compile's
rank check stopped it as an internal error (a break test). The merged dim is now inferred
(``-1``); each rank matches the model. Model: Nawrot et al. 2021, "Hierarchical
Transformers Are More Efficient Language Models", shortening by reshape."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.planning.tp import plan_tp
from tp_check import plan_and_check
from tp_small_models import captured

D, HEADS, K = 32, 4, 2


class Attention(nn.Module):
    def __init__(self, heads_from_size: bool = False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.heads_from_size = heads_from_size

    def forward(self, x):
        B, T, C = x.shape
        shape = (C // (D // HEADS), D // HEADS) if self.heads_from_size else (HEADS, C // HEADS)
        q, k, v = (t.view(B, T, *shape).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Hourglass(nn.Module):
    def __init__(self, heads_from_size: bool = False):
        super().__init__()
        self.pre, self.mid, self.post = (Attention(heads_from_size) for _ in range(3))
        self.down, self.up = nn.Linear(K * D, D), nn.Linear(D, K * D)

    def forward(self, x):
        B, T, _ = x.shape
        x = x + self.pre(x)
        short = self.down(x.reshape(B, T // K, K * D))
        short = short + self.mid(short)
        x = self.up(short).reshape(B, T, D) + x
        return x + self.post(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_merge_view_sized_at_run_time_is_made_local(tp):
    torch.manual_seed(0)
    d = plan_and_check(Hourglass(), (torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)),), tp)
    assert {f"{m}.qkv.weight" for m in ("pre", "mid", "post")} <= d.column
    assert {f"{m}.proj.weight" for m in ("pre", "mid", "post")} <= d.row


def test_heads_counted_at_run_time_are_kept_replicated_not_miswritten():
    """``view(B, T, C // head_dim, head_dim)`` with that C: no local count can be written into
    the view, so the attention stays whole (reported), never a program with global heads."""
    d = plan_tp(captured(Hourglass(heads_from_size=True), (torch.randn(2, 8, D),)).gm.graph, 2,
                allow_replicated=True)
    assert "post.qkv.weight" not in d.column and any(
        line.startswith("kept replicated:") and "post.qkv.weight" in line for line in d.report)
