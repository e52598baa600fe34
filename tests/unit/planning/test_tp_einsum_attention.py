"""Attention written with ``torch.einsum`` (x-transformers, lucidrains' style): scores by
``einsum("b h i d, b h j d -> b h i j", q, k)``, a learned per-head temperature of shape
(heads, 1, 1), a manual softmax and ``einsum("b h i j, b h j d -> b h i d", attn, v)``.

Capture keeps ``aten.einsum`` whole (only einsum projections become linears) and DTensor has
no strategy for it, so before the einsum rule every einsum over head-sharded q, k, v
all-gathered its operands: attention ran whole on every rank, the per-head temperature stayed
replicated and o_proj's input was cut back to the rank's block (the zoo's x_transformers
family: 16 of 18 matrices sharded, an all-gather per einsum). Now the einsums keep the heads
sharded: no redistribution, the temperature is split along the heads.

Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp

from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch

HEADS, D = 4, 8


class EinsumAttention(nn.Module):
    """Causal attention by einsum; ``eq`` picks the spelling of the scores equation."""

    def __init__(self, eq="b h i d, b h j d -> b h i j", scale=True):
        super().__init__()
        self.eq = eq
        self.q, self.k, self.v = (nn.Linear(H, HEADS * D, bias=False) for _ in range(3))
        self.o = nn.Linear(HEADS * D, H, bias=False)
        self.scale = nn.Parameter(torch.full((HEADS, 1, 1), 3.0)) if scale else None

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, HEADS, -1).permute(0, 2, 1, 3)
                   for t in (self.q(x), self.k(x), self.v(x)))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        dots = torch.einsum(self.eq, q, k)
        if self.scale is not None:
            dots = dots * self.scale
        mask = torch.ones((n, n), dtype=torch.bool, device=x.device).triu(1)
        attn = dots.masked_fill(mask, -torch.finfo(dots.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return x + self.o(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def _planned(tp, **kw):
    torch.manual_seed(0)
    model = EinsumAttention(**kw)
    cap = captured(model, x_batch())
    decision = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, decision)
    return model, cap.gm, decision


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("eq", ["b h i d, b h j d -> b h i j", "bhid,bhjd->bhij",
                                "...id,...jd->...ij"])
def test_einsum_attention_keeps_the_heads_sharded(tp, eq):
    """q, k, v column, o row, the per-head temperature split along the heads, and no
    redistribution: each rank's einsums run on its own heads."""
    model, gm, d = _planned(tp, eq=eq)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    assert not d.redistributions, d.redistributions
    assert not any(line.startswith("replicated: scale") for line in d.report), d.report
    assert_tp_matches(model, x_batch(), tp, d, gm)


def test_einsum_contracting_the_sharded_letter_still_matches():
    """An einsum that sums over the heads (``"bhid,bhjd->bij"``: scores averaged over the
    heads) cannot keep them sharded: the rule refuses and the result still equals the
    model."""

    class SumHeads(EinsumAttention):
        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (t.reshape(b, n, HEADS, -1).permute(0, 2, 1, 3)
                       for t in (self.q(x), self.k(x), self.v(x)))
            attn = torch.einsum("bhid,bhjd->bij", q, k).softmax(dim=-1)
            out = torch.einsum("bij,bhjd->bhid", attn, v)
            return x + self.o(out.permute(0, 2, 1, 3).reshape(b, n, -1))

    torch.manual_seed(0)
    model = SumHeads(scale=False)
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    assert_tp_matches(model, x_batch(), 2, d, cap.gm)


class ExpertChoiceFFN(nn.Module):
    """An expert-choice MoE's experts (Zhou et al. 2022, §3.1): each expert takes its top-C
    tokens by ``gather``, and its FFN is written as einsums over the (batch, expert,
    capacity) token dims by 3-D weights, then ``scatter_add`` back."""

    def __init__(self, experts=4, ffn=16, cap=3):
        super().__init__()
        self.cap = cap
        self.router = nn.Linear(H, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, H, ffn) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, H) * ffn ** -0.5)

    def forward(self, x):
        b, t, d = x.shape
        e = self.w1.shape[0]
        g, idx = self.router(x).softmax(-1).transpose(1, 2).topk(self.cap, dim=-1)
        xin = torch.gather(x.unsqueeze(1).expand(b, e, t, d), 2,
                           idx.unsqueeze(-1).expand(b, e, self.cap, d))
        h = F.gelu(torch.einsum("becd,edf->becf", xin, self.w1))
        y = torch.einsum("becf,efd->becd", h, self.w2) * g.unsqueeze(-1)
        rows = idx.reshape(b, e * self.cap, 1).expand(b, e * self.cap, d)
        return x + torch.zeros_like(x).scatter_add(1, rows, y.reshape(b, e * self.cap, d))


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_einsums_over_several_token_dims_are_column_and_row(tp):
    """``einsum('becd,edf->becf')`` has two free letters of the tokens (b, c): it was left
    an einsum, which no rule takes, and the compile was refused ("no weight matrix could be
    sharded", a held-out zoo's expert-choice MoE) although the same experts written with
    ``bmm`` shard. The token letters are folded into one dim now, as torch's einsum folds
    them: w1 column (Shard(2)), w2 row (Shard(1)), each rank equal to the model."""
    torch.manual_seed(0)
    model = ExpertChoiceFFN()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, tp)
    assert d.column == {"w1"} and d.row == {"w2"}, d.report
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    assert_tp_matches(model, x_batch(), tp, d, cap.gm)


class ShuffledGroupsBlock(nn.Module):
    """Attention, then a grouped FFN by einsums over (G, D/G, F/G) weights with a channel
    shuffle between them (ShuffleNet's transpose of the groups and their features)."""

    def __init__(self, groups=2, ffn=32):
        super().__init__()
        self.g, self.f = groups, ffn
        self.attn = EinsumAttention(scale=False)
        self.w1 = nn.Parameter(torch.randn(groups, H // groups, ffn // groups) * 0.2)
        self.w2 = nn.Parameter(torch.randn(groups, ffn // groups, H // groups) * 0.2)

    def forward(self, x):
        b, t, _ = x.shape
        g, f = self.g, self.f
        x = self.attn(x)
        h = F.gelu(torch.einsum("btgd,gdf->btgf", x.view(b, t, g, H // g), self.w1))
        h = h.view(b, t, g, g, f // g // g).transpose(2, 3).reshape(b, t, g, f // g)
        return x + torch.einsum("btgf,gfd->btgd", h, self.w2).reshape(b, t, H)


def test_a_row_whose_input_no_column_shards_drops_its_own_group_only():
    """The grouped FFN's einsums are G linears side by side now (decision 115); the shuffle
    leaves w2's input unsharded along its features, and that conflict named no group, so it
    dropped every group: the compile was refused, attention included ("no weight matrix
    could be sharded", a held-out zoo's grouped-linear model, 4 of 8 matrices before). The
    row's own group is dropped: attention stays sharded, the FFN whole, each rank equal to
    the model."""
    torch.manual_seed(0)
    model = ShuffledGroupsBlock()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"attn.q.weight", "attn.k.weight", "attn.v.weight"}, d.report
    assert d.row == {"attn.o.weight"}, d.report
    assert any(line.startswith("kept replicated: w1, w2 (") for line in d.report), d.report
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    assert_tp_matches(model, x_batch(), 2, d, cap.gm)
