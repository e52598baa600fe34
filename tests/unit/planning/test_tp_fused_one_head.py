"""Multi-query attention inside one fused projection split by sizes along its features:
GPTBigCode's ``c_attn(x).unsqueeze(1).split((E, D, D), dim=3)``. Split evenly, the k and v
parts (one head of head_dim D each) put their shard on head_dim, so q, k and v were
all-gathered before attention and every tp rank computed attention whole (3 all-gathers and
a scatter per layer) while report.md counted c_attn sharded. Now a part whose size-1 dim is
spread over the query heads (repeat_kv's expand, SDPA's enable_gqa) is one kv head copied
to every rank: c_attn is ``fused [E, D, D]`` with ``replicated_heads(1, D)`` parts, no
redistribution is left, and each rank equals the unmodified model (outputs, every
gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.plan.layouts import Fused, ReplicatedHeads

from tp_check import assert_tp_matches, planned
from tp_small_models import H, ids_batch, tiny_lm, x_batch

HEADS, D = 4, 8
COPIED = Fused((H, D, D), (None, ReplicatedHeads(1, D), ReplicatedHeads(1, D)))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_bigcode_multi_query_copies_its_kv_part(tp):
    model = tiny_lm(
        "GPTBigCode",
        vocab_size=64, n_embd=H, n_layer=2, n_head=HEADS, n_inner=64, multi_query=True,
        tie_word_embeddings=False, use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0)
    batch = (ids_batch()["input_ids"],)
    gm, d = planned(model, batch, tp)
    for i in range(2):
        attn = f"lm.transformer.h.{i}.attn"
        assert f"{attn}.c_attn.weight" in d.column and f"{attn}.c_proj.weight" in d.row
        assert d.layouts[f"{attn}.c_attn.weight"] == COPIED
        assert d.layouts[f"{attn}.c_attn.bias"] == COPIED
    assert d.redistributions == []
    assert_tp_matches(model, batch, tp, d, gm)


class FusedGQA(nn.Module):
    """The same split, its one kv head spread by SDPA's enable_gqa."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(H, H + 2 * D), nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).unsqueeze(1).split((H, D, D), dim=3)
        q = q.view(b, t, HEADS, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.c_proj(y.transpose(1, 2).reshape(b, t, H))


def test_one_kv_head_spread_by_enable_gqa_is_copied():
    torch.manual_seed(0)
    model = FusedGQA()
    gm, d = planned(model, x_batch(), 2)
    assert d.layouts["c_attn.weight"] == COPIED and d.redistributions == []
    assert_tp_matches(model, x_batch(), 2, d, gm)


class PartReadElsewhere(FusedGQA):
    """The k part is also read outside attention, summed over its features: no rank holds
    a copy through that use, so the parts are split evenly and attention takes them
    gathered (correct, not copied)."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).unsqueeze(1).split((H, D, D), dim=3)
        q = q.view(b, t, HEADS, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.c_proj(y.transpose(1, 2).reshape(b, t, H)) + k.sum(-1).transpose(1, 2)


def test_a_part_read_outside_attention_is_not_copied():
    torch.manual_seed(0)
    model = PartReadElsewhere()
    gm, d = planned(model, x_batch(), 2)
    assert d.layouts.get("c_attn.weight") != COPIED
    assert_tp_matches(model, x_batch(), 2, d, gm)


class TransposedFirst(FusedGQA):
    """k transposed before repeat_kv's expand (``k.transpose(-1, -2).expand(b, H, D, t)``),
    attention by bmm over (batch x heads): the one-head part is followed through the
    transpose and copied. ``elsewhere``: k is also summed outside attention, so it is not
    copied; its shard then stays on head_dim and attention is replicated (the MLP sharded).
    That run was an
    internal error: a cut of a replicated per-head value (the narrow the bmm asked for) was
    applied to the expand, whose input was sharded, and the expand kept its global size."""

    def __init__(self, elsewhere=False):
        super().__init__()
        self.elsewhere = elsewhere
        self.up, self.down = nn.Linear(H, 64), nn.Linear(64, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).unsqueeze(1).split((H, D, D), dim=3)
        q = q.reshape(b, t, HEADS, D).transpose(1, 2).reshape(b * HEADS, t, D)
        kt = k.transpose(-1, -2).expand(b, HEADS, D, t).reshape(b * HEADS, D, t)
        vv = v.expand(b, HEADS, t, D).reshape(b * HEADS, t, D)
        att = torch.bmm(q, kt).mul(D ** -0.5).softmax(-1)
        y = torch.bmm(att, vv).view(b, HEADS, t, D).transpose(1, 2).reshape(b, t, H)
        out = x + self.c_proj(y)
        out = out + self.down(F.gelu(self.up(out)))
        return out + k.sum(-1).transpose(1, 2) if self.elsewhere else out


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_one_head_part_transposed_before_its_expand(elsewhere):
    torch.manual_seed(0)
    model = TransposedFirst(elsewhere)
    gm, d = planned(model, x_batch(), 2)
    assert (d.layouts.get("c_attn.weight") == COPIED) is not elsewhere
    assert_tp_matches(model, x_batch(), 2, d, gm)


class SeparateUnsqueezed(nn.Module):
    """The separate-projection form: k_proj and v_proj of one head each, unsqueezed to
    (B, 1, T, D) (no view into (.., 1, head_dim)) and expanded over the query heads, k
    transposed first when ``transpose_first``. Found by a new-user break test: attention was
    kept replicated (4 of 12 matrices). Now k_proj and v_proj are one copied kv head
    (cuts.py one_head_unsqueeze) and attention is sharded over the query heads."""

    def __init__(self, transpose_first=False):
        super().__init__()
        self.transpose_first = transpose_first
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, D), nn.Linear(H, D)
        self.o = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).unsqueeze(1).reshape(b, t, HEADS, D).transpose(1, 2).reshape(b * HEADS, t, D)
        k, v = self.k(x).unsqueeze(1), self.v(x).unsqueeze(1)
        if self.transpose_first:
            kt = k.transpose(-1, -2).expand(b, HEADS, D, t).reshape(b * HEADS, D, t)
        else:
            kt = k.expand(b, HEADS, t, D).reshape(b * HEADS, t, D).transpose(-1, -2)
        vv = v.expand(b, HEADS, t, D).reshape(b * HEADS, t, D)
        att = torch.bmm(q, kt).mul(D ** -0.5).softmax(-1)
        return x + self.o(torch.bmm(att, vv).view(b, HEADS, t, D).transpose(1, 2).reshape(b, t, H))


@pytest.mark.parametrize("tp, transpose_first", [(2, False), (4, False), (2, True)])
def test_separate_one_head_projections_unsqueezed_are_copied(tp, transpose_first):
    torch.manual_seed(0)
    model = SeparateUnsqueezed(transpose_first)
    gm, d = planned(model, x_batch(), tp)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    assert d.layouts["k.weight"] == d.layouts["v.weight"] == ReplicatedHeads(1, D)
    assert d.redistributions == []
    assert_tp_matches(model, x_batch(), tp, d, gm)


class BroadcastMatmulMQA(nn.Module):
    """Multi-query attention by broadcasting: ``q @ k.transpose(-1, -2)`` with k of one head
    ``(B, 1, T, D)``, no expand and no SDPA; k and v from one fused projection split by
    sizes, or from two projections."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.q, self.o = nn.Linear(H, H), nn.Linear(H, H)
        if fused:
            self.kv = nn.Linear(H, 2 * D)
        else:
            self.k, self.v = nn.Linear(H, D), nn.Linear(H, D)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k, v = self.kv(x).split(D, dim=-1) if self.fused else (self.k(x), self.v(x))
        att = (q @ k.unsqueeze(1).transpose(-1, -2)).mul(D ** -0.5).softmax(-1)
        return x + self.o((att @ v.unsqueeze(1)).transpose(1, 2).reshape(b, t, H))


@pytest.mark.parametrize("tp, fused", [(2, True), (4, True), (2, False), (4, False)])
def test_one_head_broadcast_by_matmul_is_kept_whole_and_the_rest_sharded(tp, fused):
    """The fused one-head projection is kept whole (split, its shard would land on
    head_dim: q, k and v were then kept replicated, "a linear got a (batch, heads) merged
    input"); its one head broadcasts against each rank's query heads (the matmul rule for a
    replicated operand of size 1 along the sharded batch dim). Separate k and v projections
    are each one kv head copied to every rank (``replicated_heads(1, D)``), the matmul
    broadcasting the copy as SDPA's ``enable_gqa`` does. q and o are sharded, with no
    redistribution, and each rank equals the unmodified model."""
    torch.manual_seed(0)
    model = BroadcastMatmulMQA(fused)
    gm, d = planned(model, x_batch(), tp)
    kv = set() if fused else {"k.weight", "v.weight"}
    assert d.column == {"q.weight"} | kv and d.row == {"o.weight"}, (d.column, d.row)
    assert all(d.layouts[w] == ReplicatedHeads(1, D) for w in kv)
    assert d.redistributions == []
    assert_tp_matches(model, x_batch(), tp, d, gm)


class FusedRotaryMQA(nn.Module):
    """A fused q | k | v projection split by sizes, k and v one head each with no heads
    dim, rotary on k before (``rope(k).unsqueeze(1)``) or after (``rope(k.unsqueeze(1))``)
    its heads dim, attention by matmuls broadcasting the one head (hand-written PaLM, a
    held-out zoo: the fused projection was kept whole, 4 of 6 matrices sharded)."""

    def __init__(self, rotary_first: bool):
        super().__init__()
        self.rotary_first = rotary_first
        self.qkv, self.o = nn.Linear(H, H + 2 * D, bias=False), nn.Linear(H, H, bias=False)

    @staticmethod
    def rope(x):
        t = x.shape[-2]
        f = torch.outer(torch.arange(t, device=x.device).float(),
                        1.0 / 10000 ** (torch.arange(0, D, 2, device=x.device).float() / D))
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((H, D, D), dim=-1)
        q = self.rope(q.view(b, t, HEADS, D).transpose(1, 2))
        k = self.rope(k).unsqueeze(1) if self.rotary_first else self.rope(k.unsqueeze(1))
        att = (q * D ** -0.5 @ k.transpose(-1, -2)).softmax(-1)
        return x + self.o((att @ v.unsqueeze(1)).transpose(1, 2).reshape(b, t, H))


@pytest.mark.parametrize("tp, rotary_first", [(2, True), (4, True), (2, False)])
def test_a_fused_one_head_part_through_rotary_and_matmul_is_copied(tp, rotary_first):
    """The k and v parts are copied kv heads (rotary's element-wise ops with its tables,
    rotate_half's chunks and cat, then the matmul's broadcast count as spreading the one
    head over the query heads; before the heads dim the part is held whole), the q part
    and o sharded, no redistribution; outputs, every gradient and one SGD step match."""
    torch.manual_seed(0)
    model = FusedRotaryMQA(rotary_first)
    gm, d = planned(model, x_batch(t=6), tp)
    assert d.column == {"qkv.weight"} and d.row == {"o.weight"}, (d.column, d.row)
    assert d.layouts["qkv.weight"] == Fused((H, D, D), (None, ReplicatedHeads(1, D),
                                                        ReplicatedHeads(1, D)))
    assert d.redistributions == []
    assert_tp_matches(model, x_batch(t=6), tp, d, gm)


class PaLMBlock(nn.Module):
    """PaLM's parallel block (Chowdhery et al. 2022 §2): one fused projection q | k | v |
    up | gate, k and v one head with no heads dim, read by einsum against the query heads;
    attention and SwiGLU summed into the stream. Weights as raw parameters with F.linear."""

    def __init__(self, sdpa: bool, ff=2 * H, rotary=False, scan=False, qk_norm=False):
        super().__init__()
        self.sdpa, self.dims, self.rotary, self.scan = sdpa, (H, D, D, ff, ff), rotary, scan
        self.qk_norm = qk_norm
        self.fused_in = nn.Parameter(torch.randn(sum(self.dims), H) / H ** 0.5)
        self.attn_out = nn.Parameter(torch.randn(H, H) / H ** 0.5)
        self.ff_out = nn.Parameter(torch.randn(H, ff) / ff ** 0.5)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v, up, gate = F.linear(F.layer_norm(x, (H,)), self.fused_in).split(self.dims, -1)
        if self.scan:  # an op over q's features: gathered, attention then computed whole
            q = q.cumsum(-1)
        q = q.view(b, n, HEADS, D).transpose(1, 2) * D ** -0.5
        if self.rotary:
            pos = torch.arange(n, dtype=x.dtype)[:, None] * torch.arange(1, D + 1, dtype=x.dtype)
            rope = _rope if self.rotary == "palm" else _rope_interleaved
            q, k = rope(q, pos), rope(k, pos)
        if self.qk_norm:  # PaLM-rlhf-pytorch's qk_rmsnorm: an l2 norm over head_dim
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if self.sdpa:  # the same written for SDPA: the one head unsqueezed and expanded
            k, v = (t.unsqueeze(1).expand(b, HEADS, n, D) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        else:
            sim = torch.einsum("bhid,bjd->bhij", q, k)
            sim = sim.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9)
            out = torch.einsum("bhij,bjd->bhid", sim.softmax(-1), v)
        out = out.transpose(1, 2).reshape(b, n, H)
        return x + F.linear(out, self.attn_out) + F.linear(F.silu(gate) * up, self.ff_out)


def _rope(t, pos):
    """palm-pytorch's rotary embedding: rotate_half as ``rearrange('... (j d) -> ... j d',
    j=2)`` and ``unbind(dim=-2)``."""
    x1, x2 = t.reshape(*t.shape[:-1], 2, t.shape[-1] // 2).unbind(dim=-2)
    return t * pos.cos() + torch.cat((-x2, x1), dim=-1) * pos.sin()


def _rope_interleaved(t, pos):
    """rotary-embedding-torch's: the rotated middle of the features between empty left and
    right slices, rotate_half as ``rearrange('... (d r) -> ... d r', r=2)``, ``unbind(-1)``,
    ``stack`` and the view back, cast back to the input's dtype."""
    d = t.shape[-1]
    left, mid, right = t[..., :0], t[..., 0:d], t[..., d:]
    x1, x2 = mid.reshape(*mid.shape[:-1], d // 2, 2).unbind(dim=-1)
    rot = torch.stack((-x2, x1), dim=-1).reshape(mid.shape)
    return torch.cat((left, mid * pos.cos() + rot * pos.sin(), right), dim=-1).to(t.dtype)


class PaLM(nn.Module):
    def __init__(self, sdpa: bool, **kwargs):
        super().__init__()
        self.blocks = nn.ModuleList(PaLMBlock(sdpa, **kwargs) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("tp,sdpa", [(2, False), (4, False), (2, True), (4, True)])
def test_palm_one_head_parts_are_copied(tp, sdpa):
    """The k and v parts have no heads dim to place a copy on: they are held whole on every
    rank (analysis/sharding/placements.CopiedWhole), with no f, so each rank's k and v
    gradient is its query heads' contribution and the column's input f sums them once
    (an f on them summed the k and v part of dx tp times: tried, caught here). Read by
    einsum, or unsqueezed and expanded for SDPA (the new dim then carries the copy)."""
    torch.manual_seed(0)
    model = PaLM(sdpa)
    gm, d = planned(model, x_batch(), tp)
    copied = Fused((H, D, D, 2 * H, 2 * H), (None, ReplicatedHeads(1, D), ReplicatedHeads(1, D),
                                             None, None))
    for i in range(2):
        assert f"blocks.{i}.fused_in" in d.column and d.layouts[f"blocks.{i}.fused_in"] == copied
        assert {f"blocks.{i}.attn_out", f"blocks.{i}.ff_out"} <= d.row
    assert d.redistributions == [] and not d.f_edges, (d.redistributions, d.f_edges)
    assert_tp_matches(model, x_batch(), tp, d, gm)


@pytest.mark.parametrize("tp,rotary", [(2, "palm"), (4, "palm"), (2, "interleaved")])
def test_palm_rotary_on_the_one_head_keeps_it_whole(tp, rotary):
    """palm-pytorch's rotary on k before the einsum, rotate_half spelled with a ``(j d) ->
    j d`` view and ``unbind`` (zoo 12 F6): k was split along head_dim and gathered, q gathered
    at the einsum, and v, held whole, met attention computed whole, so its copies' gradients
    were summed over tp though each rank's was whole: wrong gradients (the self-check caught
    it; with ``--no-self-check`` the program was emitted). Any op computing from the head
    and values without a gradient keeps it one head: k is held whole like v (also through
    rotary-embedding-torch's interleaved rotate_half, 13 ops deep)."""
    _copied_and_matching(tp, rotary=rotary)


def _copied_and_matching(tp: int, **kwargs) -> None:
    """PaLM (einsum attention) with ``kwargs``: every block's fused projection a column,
    no redistribution and no f, and the ranks in lockstep equal the model."""
    torch.manual_seed(0)
    model = PaLM(False, **kwargs)
    gm, d = planned(model, x_batch(), tp)
    assert all(f"blocks.{i}.fused_in" in d.column for i in range(2)), d.report
    assert d.redistributions == [] and not d.f_edges, (d.redistributions, d.f_edges)
    assert_tp_matches(model, x_batch(), tp, d, gm)


def test_a_one_head_part_met_by_attention_computed_whole_is_not_copied():
    """q scanned over its features (gathered first) makes attention whole on every rank: a
    copy of v read there gets the whole gradient on each rank, not its query heads' share
    (``propagate._copies_met_whole``). So k and v are not copied: v is split along its
    head_dim, attention's output with it, and attn_out's input features are laid out as
    that (heads, head_dim) merge with head_dim cut (decision 223; the projection was kept
    whole before), and every rank equals the model (before that: an internal error naming
    a Mixed gradient)."""
    torch.manual_seed(0)
    model = PaLM(False, scan=True)
    gm, d = planned(model, x_batch(), 2)
    for i in range(2):
        assert d.layouts[f"blocks.{i}.fused_in"] == Fused((H, D, D, 2 * H, 2 * H)), d.report
        assert d.layouts[f"blocks.{i}.attn_out"] == Fused((D,) * HEADS), d.report
    assert_tp_matches(model, x_batch(), 2, d, gm)


@pytest.mark.parametrize("tp", [2, 4])
def test_palm_qk_norm_on_the_one_head_keeps_it_copied(tp):
    """PaLM-rlhf-pytorch's ``qk_rmsnorm``: ``F.normalize(k, dim=-1)`` of the one k head
    divides it by its norm ``expand_as(k)``, whose sizes are read off k (``sym_size``): those
    counted as inputs computed from the weights, so the result was no copy any more and the
    whole fused projection, its FFN part too, stayed whole (zoo 16 Z5: 4 of 6 matrices)."""
    _copied_and_matching(tp, qk_norm=True)
