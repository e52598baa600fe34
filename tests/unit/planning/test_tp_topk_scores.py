"""A top-k over attention scores (x-transformers' ``attn_sparse_topk``: each query keeps its k
largest scores, the rest masked before the softmax). The seed walk took every top-k for a
mixture-of-experts router's and ended there, so q and k paired with nothing ("no column/row
pair found", zoo 13 Z14: 20 of 28 matrices). A top-k along a dim other than the walked
linear's features picks within each head: q | k | v | o pair as in any attention, and every
rank equals the unmodified model (outputs, every gradient, one SGD step; fp32)."""
import pytest
import torch
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H, x_batch

HEADS = 4


class SparseTopkAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2)
        top, _ = s.topk(2, dim=-1)
        s = s.masked_fill(s < top[..., -1:], -1e9)
        return x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_top_k_over_the_keys_leaves_q_and_k_paired(tp):
    torch.manual_seed(0)
    d = plan_and_check(SparseTopkAttention(), x_batch(2, 6), tp)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}, d.report
    assert d.redistributions == [], d.redistributions
