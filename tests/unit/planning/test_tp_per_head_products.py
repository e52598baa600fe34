"""A product with one 2-D weight that contracts another dim than a column's sharded features.

A relative-position bias computed per head with one P for every head (``rel(h).view(B, T,
H, d) @ P`` added to the scores: transformers' Inkling2-loop, a held-out zoo's plain-torch
reproducer), and Linformer's projection of the keys and values over the sequence
(``E(k(x).transpose(1, 2))``, another zoo's). The walk took P (E) for the row of ``rel``'s
(``k``'s) pair; its input is sharded along the heads (the features, moved off the last dim),
not along what it contracts, so the pair conflicted, and the conflict, naming no group,
dropped every group: both models were refused at tp 2 ("no weight matrix could be
sharded"), Inkling2-loop sharded only its experts (8 of 92 matrices). Such a product keeps
the shard of the dim it does not contract (DTensor's mm strategy for a sharded batch dim),
the weight stays whole with its gradient summed over tp (Partial), and the walk from q and k
goes on through the bias add (an add wider than the stream is no block end). Past a norm or
the residual stream a product along another dim is a row again: MLP-Mixer's channel MLP
after its token MLP keeps both pairs.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check

D, H, DR, T, KP = 32, 4, 4, 6, 3
HD = D // H


class RelBiasAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.rel = nn.Linear(D, H * DR, bias=False)
        self.P = nn.Parameter(torch.randn(DR, T) * 0.1)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        B, N, _ = x.shape
        h = self.norm(x)
        q, k, v = (f(h).view(B, N, H, HD).transpose(1, 2) for f in (self.q, self.k, self.v))
        bias = (self.rel(h).view(B, N, H, DR) @ self.P).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / HD ** 0.5 + bias
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))
        return x + self.fc2(F.gelu(self.fc1(x)))


class LinformerAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.E, self.F = nn.Linear(T, KP, bias=False), nn.Linear(T, KP, bias=False)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, H, HD).transpose(1, 2)
        k, v = (p(f(x).transpose(1, 2)).transpose(1, 2).reshape(B, KP, H, HD).transpose(1, 2)
                for p, f in ((self.E, self.k), (self.F, self.v)))
        s = (q @ k.transpose(-1, -2) / HD ** 0.5).softmax(-1)
        return x + self.o((s @ v).transpose(1, 2).reshape(B, N, D))


@pytest.mark.parametrize("model, shared, column, dim", [
    (RelBiasAttention, "P", "rel.weight", 2), (LinformerAttention, "E.weight", "k.weight", 1)])
def test_a_product_along_another_dim_keeps_the_shard_and_sums_its_weight_gradient(
        model, shared, column, dim):
    torch.manual_seed(0)
    d = plan_and_check(model(), (torch.randn(2, T, D),), 2)
    assert {"q.weight", "k.weight", "v.weight", column} <= d.column and "o.weight" in d.row
    assert shared not in d.column | d.row and shared in d.partial
    assert not d.redistributions, d.redistributions
    line = (f"replicated linear: {shared} (applied whole to each rank's shard of its input along "
            f"dim {dim}, a dim it does not contract (the sharded output of {column})")
    assert any(r.startswith(line) for r in d.report), d.report


PATCHES, CHANNELS = 16, 8  # the token MLP's features a multiple of the channels


class MixerBlock(nn.Module):
    """MLP-Mixer (lucidrains' mlp-mixer-pytorch): a token MLP over the patches (transposed),
    then a channel MLP, pre-norm residuals."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(CHANNELS), nn.LayerNorm(CHANNELS)
        self.t1, self.t2 = nn.Linear(PATCHES, 2 * PATCHES), nn.Linear(2 * PATCHES, PATCHES)
        self.c1, self.c2 = nn.Linear(CHANNELS, 2 * CHANNELS), nn.Linear(2 * CHANNELS, CHANNELS)

    def forward(self, x):
        x = x + self.t2(F.gelu(self.t1(self.norm1(x).transpose(1, 2)))).transpose(1, 2)
        return x + self.c2(F.gelu(self.c1(self.norm2(x))))


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(MixerBlock(), MixerBlock())
        self.head = nn.Linear(CHANNELS, 5)

    def forward(self, images):
        x = self.blocks(self.stem(images).flatten(2).transpose(1, 2))
        return self.head(x.mean(1))


def test_a_channel_mlp_after_a_token_mlp_is_a_pair_of_its_own():
    """The token MLP's output, transposed back, reaches the channel MLP's ``c1`` through the
    residual add and a norm: ``c1`` contracts another dim than ``t2``'s features, but past
    the stream and a norm it is no product within ``t2``'s pair (it was left out of every
    pair: a plan-diff sweep's MLP-Mixer lost its first channel MLP)."""
    torch.manual_seed(0)
    d = plan_and_check(Mixer(), (torch.randn(2, 3, 16, 16),), 2)
    assert {f"blocks.{b}.{w}.weight" for b in "01" for w in ("t1", "c1")} == d.column
    assert {f"blocks.{b}.{w}.weight" for b in "01" for w in ("t2", "c2")} == d.row
