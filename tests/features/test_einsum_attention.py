"""Attention written with ``torch.einsum`` of two activations (CompVis ldm's CrossAttention,
the zoo's ``ldm_attention``): ``einsum('b i d, b j d -> b i j', q, k) * scale`` with the heads
merged into the batch by hand, softmax, ``einsum('b i j, b j d -> b i d', attn, v)``, and
the 4-D ``'bhid,bhjd->bhij'``. No sharding rule took ``aten.einsum``, so each such attention
and its to_q/to_k/to_v/to_out were kept replicated (ldm_attention: 4 of 24 matrices at tp2
and tp4). Capture now rewrites an einsum that is a batched matrix product into
``aten.matmul`` of permutes (parallelizer/frontend/einsum.py ``_batched_matmul``), which the
rules take as ``q @ k.transpose(-2, -1)``. Each rank equals the unmodified model in lockstep
(outputs, every gradient, one SGD step; fp32, 1e-5). An einsum that is no batched matmul
(a sum over a dim of one operand) is left as it is."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelizer.analysis.graph_facts import aten
from tp_check import plan_and_check
from tp_small_models import H, captured, x_batch

HEADS = 4


class EinsumAttention(nn.Module):
    def __init__(self, four_d: bool = False, context: bool = False):
        super().__init__()
        self.four_d, self.context = four_d, context
        self.to_q = nn.Linear(H, H, bias=False)
        self.to_k = nn.Linear(H, H, bias=False)
        self.to_v = nn.Linear(H, H, bias=False)
        self.to_out = nn.Linear(H, H)

    def forward(self, x, ctx=None):
        h, d = HEADS, H // HEADS
        c = ctx if self.context else x
        q, k, v = self.to_q(x), self.to_k(c), self.to_v(c)
        if self.four_d:
            q, k, v = (t.reshape(t.shape[0], t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))
            attn = torch.einsum("bhid,bhjd->bhij", q, k).mul(d ** -0.5).softmax(-1)
            out = torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2)
            return x + self.to_out(out.reshape(x.shape))
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, d).permute(0, 2, 1, 3)
                   .reshape(t.shape[0] * h, t.shape[1], d) for t in (q, k, v))
        attn = (torch.einsum("b i d, b j d -> b i j", q, k) * d ** -0.5).softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        out = out.reshape(-1, h, out.shape[1], d).permute(0, 2, 1, 3).reshape(x.shape)
        return x + self.to_out(out)


def _batch(context: bool):
    g = torch.Generator().manual_seed(5)
    x = x_batch(2, 6)
    return x + (torch.randn(2, 3, H, generator=g),) if context else x


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("four_d,context", [(False, False), (False, True), (True, False)])
def test_einsum_attention_is_sharded_by_heads(four_d, context, tp):
    torch.manual_seed(0)
    d = plan_and_check(EinsumAttention(four_d, context), _batch(context), tp)
    assert d.column == {"to_q.weight", "to_k.weight", "to_v.weight"} and d.row == {"to_out.weight"}


def test_an_einsum_that_is_no_batched_matmul_is_left_as_it_is():
    class Trace(nn.Module):
        def forward(self, x):
            return torch.einsum("bsd,bsd->bs", x, x), torch.einsum("bij,bjk->bik", x, x.transpose(1, 2))
    gm = captured(Trace(), x_batch()).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.einsum.default in targets and aten.matmul.default in targets


class RelativeAttention(nn.Module):
    """Transformer-XL's relative attention as labml-nn writes it (Dai et al. 2019, §3.3), seq
    first: a learned table of key positions per head (P, heads, d) and a bias per position and
    head (P, heads), sliced by the lengths and read by ``einsum("ibhd,jhd->ijbh")``."""

    P = 16

    def __init__(self):
        super().__init__()
        d = H // HEADS
        self.qkv, self.out = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H)
        self.pos = nn.Parameter(torch.randn(2 * self.P, HEADS, d) * 0.1)
        self.pos_bias = nn.Parameter(torch.randn(2 * self.P, HEADS) * 0.1)

    def forward(self, x):
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, HEADS, -1).unbind(2)
        pos = self.pos[self.P - s:self.P + s]
        bias = self.pos_bias[self.P - s:self.P][None, :, None]
        scores = torch.einsum("ibhd,jbhd->ijbh", q, k) \
            + torch.einsum("ibhd,jhd->ijbh", q, pos)[:, :s] + bias
        attn = scores.softmax(dim=1)
        out = torch.einsum("ijbh,jbhd->ibhd", attn, v).reshape(s, b, -1)
        return x + self.out(out)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_per_head_table_read_by_einsum_is_sharded_with_the_heads(tp):
    """The table meets head-sharded queries in an einsum that keeps the heads: it is sharded
    along its heads dim (it was replicated and the queries all-gathered, the attention
    computed whole), the bias with it."""
    torch.manual_seed(0)
    d = plan_and_check(RelativeAttention(), (torch.randn(5, 2, H),), tp)
    assert d.column == {"qkv.weight"} and d.row == {"out.weight"}
    assert d.per_head == {"pos": 1, "pos_bias": 1} and not d.redistributions
