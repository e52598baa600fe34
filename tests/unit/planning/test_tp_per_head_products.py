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
goes on through the bias add (an add wider than the stream is no block end).
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
