"""Redistribution instead of refusing (analysis/sharding/redistribute.py): where no sharded
rule takes a value as it is, the planner inserts the redistribution DTensor would (an
all-gather, each rank's block of a replicated value, the all-reduce of a Partial output)
and the block keeps its sharded matmuls. Each model here was kept replicated before; each
is checked with the tp ranks in lockstep against the unmodified model (outputs, every
gradient, the parameters after one SGD step; fp32, 1e-5: tests/tp_check.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.planning import tp as tp_plan
from parallelizer.planning.tp import plan_tp
from tp_check import plan_and_check
from tp_small_models import H, captured, x_batch


class ProjectionNormAttention(nn.Module):
    """q and k normalised over the whole projection before the heads view (OLMo-2's
    q_norm / k_norm): the RMS mean runs over the sharded dim (Partial -> all-reduce)."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads, self.hd = heads, H // heads
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.q_w = nn.Parameter(torch.rand(H) + 0.5)
        self.k_w = nn.Parameter(torch.rand(H) + 0.5)

    @staticmethod
    def _norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        b, s, _ = x.shape
        q = self._norm(self.q(x), self.q_w).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self._norm(self.k(x), self.k_w).view(b, s, self.heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, H))


class DenseConvMixer(nn.Module):
    """A causal conv over the channels of a column projection, each output channel reading
    every input channel (one group; a depthwise one, Mamba's, takes the channels sharded:
    test_channel_parallel.py): gathered before the conv, cut again before the row
    projection."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.conv = nn.Conv1d(2 * H, 2 * H, 3, padding=2)

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)
        h = self.conv(h)[..., :x.shape[1]].transpose(1, 2)
        return x + self.out(F.silu(h))


class ConcatBranch(nn.Module):
    """A sharded hidden concatenated with the replicated input along the sharded dim
    (ConvBERT's context | conv output): DTensor wants both replicated."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 64), nn.Linear(64 + H, H)

    def forward(self, x):
        return x + self.down(torch.cat([F.gelu(self.up(x)), torch.tanh(x)], dim=-1))


def _sharded(decision) -> set:
    return decision.column | decision.row


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_over_a_sharded_projection_is_reduced_not_replicated(tp):
    torch.manual_seed(0)
    model = ProjectionNormAttention()
    d = plan_and_check(model, x_batch(), tp)
    assert _sharded(d) == {f"{n}.weight" for n in "qkvo"}
    kinds = {(r.kind, r.reduce_op) for r in d.redistributions}
    assert ("all_reduce", "avg") in kinds
    lines = [s for s in d.report if s.startswith("redistribution:")]
    assert len(lines) == len(d.redistributions) and all("bytes per rank per step" in s
                                                        for s in lines)


@pytest.mark.parametrize("tp", [2, 4])
def test_conv_over_sharded_channels_is_gathered(tp):
    torch.manual_seed(0)
    model = DenseConvMixer()
    d = plan_and_check(model, x_batch(t=6), tp)
    assert _sharded(d) == {"inp.weight", "out.weight"}
    assert {r.kind for r in d.redistributions} >= {"all_gather", "scatter"}
    gather = next(r for r in d.redistributions if r.kind == "all_gather")
    b, t = 2, 6
    assert gather.bytes == (tp - 1) * b * t * 2 * H * 4 // tp  # fp32, the whole value


def test_summary_line_counts_the_all_gathers():
    """A matrix counted sharded may feed an op that runs whole after an all-gather (a break
    test: q, k, v of heads laid out inner, gathered before attention, read "12 of 12
    sharded"); the count line says how many activations are gathered, and a plan with none
    says nothing more."""
    from parallelizer.planning.tp_matrices import tp_summary
    torch.manual_seed(0)
    model = DenseConvMixer()
    d = plan_and_check(model, x_batch(t=6), 2)
    n = sum(r.kind == "all_gather" for r in d.redistributions)
    assert n >= 1
    assert tp_summary(d, model).endswith(
        f"; {n} sharded activation(s) all-gathered where no sharded rule takes them, the ops "
        f"after computed whole (report.md)")
    plain = plan_tp(captured(ProjectionNormAttention(), x_batch()).gm.graph, 2)
    plain.redistributions = [r for r in plain.redistributions if r.kind != "all_gather"]
    assert tp_summary(plain, ProjectionNormAttention()).endswith("% of parameters)")


def test_cat_along_the_sharded_dim_gathers_the_shard():
    torch.manual_seed(0)
    d = plan_and_check(ConcatBranch(), x_batch(), 2)
    assert _sharded(d) == {"up.weight", "down.weight"}
    assert any(r.kind == "all_gather" and "aten.cat" in r.why for r in d.redistributions)


class LowRankThenMLP(nn.Module):
    """A low-rank pair (a -> norm -> b), a linear after it that nothing pairs, the residual,
    then an MLP: the walk from ``after`` must stop at the residual add, or it pairs ``after``
    (as column) with the MLP's ``up`` (as row) and ``down`` with nothing. (The chain
    ``a -> b -> after`` keeps ``a`` whole: ``b`` column, ``after`` its row, decision 99.)"""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.after = nn.Linear(H, 16), nn.Linear(16, H), nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 64), nn.Linear(64, H)

    def forward(self, x):
        h = self.a(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = x + self.after(F.gelu(self.b(h)))
        return x + self.down(F.gelu(self.up(x)))


def test_a_column_is_not_paired_across_the_residual_stream():
    torch.manual_seed(0)
    model = LowRankThenMLP()
    d = plan_and_check(model, x_batch(), 2)
    assert "up.weight" in d.column and "down.weight" in d.row
    assert "after.weight" not in d.column
    assert (d.column, d.row) == ({"b.weight", "up.weight"}, {"after.weight", "down.weight"})


def test_report_names_each_redistribution_with_its_op_and_line():
    model = ProjectionNormAttention()
    d = plan_tp(captured(model, x_batch()).gm.graph, 2)
    line = next(s for s in d.report if "all-reduce (avg)" in s)
    assert "aten.mean.dim" in line and "test_redistribution.py:" in line


class RepeatedKV(nn.Module):
    """kv heads repeated over the query groups by ``repeat`` (JetMoE's ``key.repeat(1,
    top_k, 1, 1)``: head ``g * K + h``, a (group, heads) merge with the heads sharded) and
    reversed along the heads, which has no sharded rule: the merged value is gathered with
    its blocks interleaved along the heads."""

    def __init__(self, heads=4, kv=2):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, H // heads
        self.q, self.o = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.k, self.v = (nn.Linear(H, kv * self.hd, bias=False) for _ in range(2))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = (p(x).view(b, t, self.kv, self.hd).transpose(1, 2) for p in (self.k, self.v))
        n = self.heads // self.kv
        k, v = k.repeat(1, n, 1, 1).flip(1), v.repeat(1, n, 1, 1).flip(1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


def test_a_merged_heads_value_is_gathered_with_its_blocks_interleaved():
    torch.manual_seed(0)
    d = plan_and_check(RepeatedKV(), x_batch(), 2)
    gathers = [r for r in d.redistributions if r.kind == "all_gather" and r.inner]
    assert gathers and all(r.inner == 2 for r in gathers), d.redistributions
    assert {"k.weight", "v.weight"} <= d.column


def test_mobilebert_at_tp2_compiles_with_its_blocks_found():
    """MobileBERT's bottleneck feeds q and k: the f on a value of one block read by the next
    block's sharded compute took the next block's module (it sat inside that block with
    the previous block's: split_blocks found the blocks interleaved, an internal error)."""
    transformers = pytest.importorskip("transformers")
    from parallelizer.api import compile as compile_program
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    cfg = transformers.MobileBertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0, embedding_size=16,
        intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
        attn_implementation="sdpa")
    model = transformers.MobileBertForMaskedLM(cfg)
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    program = compile_program(model, spec, {"input_ids": ids, "labels": ids.clone()},
                              reference=False)
    assert program.plan.stages[0].blocks == ("mobilebert.encoder.layer.0",
                                             "mobilebert.encoder.layer.1")


class HyperConnections(nn.Module):
    """DeepSeek-V4's hyper-connections, cut down: ``n`` residual streams (B, S, n, H), weights
    per stream from one linear over all of them (``fn``), the streams collapsed by their
    ``pre`` weights into the MLP's input and its output spread back by ``post``. The planner
    shards the streams, so the collapse is Partial: reduced, then cut for a row linear
    (Partial -> Replicate -> Shard), the cut read from the reduced value."""

    def __init__(self, n=2):
        super().__init__()
        self.n = n
        self.fn = nn.Linear(n * H, 2 * n, bias=False)
        self.scale = nn.Parameter(torch.rand(2) + 0.5)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.up2, self.down2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def _block(self, h, up, down):
        b, s = h.shape[:2]
        pre_w, post_w = self.fn(h.reshape(b, s, -1)).split([self.n, self.n], dim=-1)
        pre = torch.sigmoid(pre_w * self.scale[0])
        post = torch.sigmoid(post_w * self.scale[1])
        x = (pre.unsqueeze(-1) * h).sum(2)
        return post.unsqueeze(-1) * down(F.gelu(up(x))).unsqueeze(-2) + h

    def forward(self, x):
        h = x.unsqueeze(2).repeat(1, 1, self.n, 1)
        h = self._block(self._block(h, self.up, self.down), self.up2, self.down2)
        return h.sum(2)


def test_a_reduced_partial_value_is_cut_from_its_reduction(monkeypatch):
    """The cut was inserted on the Partial value itself and left unread, the reader kept the
    whole reduced value: a gradient Mixed over tp (the compile's accounting raised an internal
    error on DeepSeek-V4 at tp2). The walks' own pairing (``fn`` column, ``up2`` row) is
    checked: the plan taken keeps ``fn``, the head of a chain, whole (decision 99), and
    shards both MLPs with no redistribution."""
    torch.manual_seed(0)
    d = plan_and_check(HyperConnections(), x_batch(), 2)
    assert (d.column, d.row, d.redistributions) == (
        {"up.weight", "up2.weight"}, {"down.weight", "down2.weight"}, [])
    monkeypatch.setattr(tp_plan, "chains_whole", lambda graph, sites, tp, decision, chosen: chosen)
    torch.manual_seed(0)
    d = plan_and_check(HyperConnections(), x_batch(), 2)
    reduced = {r.producer for r in d.redistributions if r.kind == "all_reduce"}
    assert any(r.kind == "scatter" and r.producer in reduced for r in d.redistributions), \
        d.redistributions


class NormOverColumn(nn.Module):
    """An L2 norm over a column linear's sharded features (SwiftFormer's additive attention
    normalises its query and key): ``normalize`` spells it ``x / norm.expand_as(x)``."""

    def __init__(self, spelled="norm"):
        super().__init__()
        self.spelled = spelled
        self.up, self.down = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        h = self.up(x)
        h = F.normalize(h, dim=-1) if self.spelled == "normalize" else \
            h / torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        return x + self.down(h)


@pytest.mark.parametrize("spelled", ["norm", "normalize"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_p_norm_over_sharded_features_is_gathered_not_summed(tp, spelled):
    """DTensor gives the norm a ``_NormPartial`` whose reduce_op reads "sum": the ranks'
    norms were all-reduced as a sum (sqrt(a² + b²) taken for a + b), a wrong value and
    gradient; no redistribution reduces it now, the features are gathered. F.normalize's
    ``expand_as(h)`` took the rank's local size from ``h`` and was then cut again (a shape
    error): capture spells it as ``expand`` with ``h``'s sizes."""
    torch.manual_seed(0)
    d = plan_and_check(NormOverColumn(spelled), x_batch(), tp)
    assert _sharded(d) == {"up.weight", "down.weight"}
    assert not any(r.kind == "all_reduce" for r in d.redistributions), d.redistributions


class EmptyCacheAttention(nn.Module):
    """Attention whose k and v are concatenated after an empty cache (a legacy 1-D empty
    tensor, which ``torch.cat`` accepts beside any shape: XLM's DynamicCache before its
    first update). DTensor asks the empty tensor for the heads' Shard it has no dim for; the
    planner used to raise IndexError there (an internal error at tp2 and tp4)."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads, self.hd = heads, H // heads
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.register_buffer("cache", torch.empty(0), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        k, v = torch.cat([self.cache, k], dim=-2), torch.cat([self.cache, v], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, H))


@pytest.mark.parametrize("tp", [2, 4])
def test_cat_after_an_empty_cache_plans_and_matches(tp):
    torch.manual_seed(0)
    d = plan_and_check(EmptyCacheAttention(), x_batch(), tp)
    assert {"q.weight", "k.weight", "v.weight"} <= d.column and "o.weight" in d.row


class SubLayerNorm(nn.Module):
    """Magneto's sub-LN (torchscale ``subln=True``, Kosmos-2's text model): a LayerNorm over
    the attention output before out_proj and over the FFN hidden before fc2. The walk from
    q/k/v and fc1 ended at each norm, as at a block's input norm, and a model of such
    blocks was refused ("no weight matrix could be sharded", zoo 16 Z1). The attention's
    norm (over v's features merged back from the heads, passes/norms_over_projections.py)
    and torchscale's FFN norm (``gelu(fc1(h).float()).type_as(..)``) are written out: their
    means all-reduced. A norm the pass leaves whole (here a shift before it) is gathered
    (planning/tp_seeds.py): the walk goes on to a row that ends the block; not to a head's
    (``dense -> LayerNorm -> decoder``, the logits no residual adds): that pairs nothing."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.ln, self.fln, self.sln = nn.LayerNorm(H), nn.LayerNorm(2 * H), nn.LayerNorm(2 * H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.up2, self.down2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.dense, self.head_ln, self.decoder = nn.Linear(H, H), nn.LayerNorm(H), nn.Linear(H, 40)
        with torch.no_grad():
            for norm in (self.ln, self.fln, self.sln, self.head_ln):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, H)
        x = x + F.dropout(self.o(self.ln(y)), 0.0, self.training)
        # torchscale's FFN: tokens flattened before fc1, the shape restored after fc2
        h = self.up(x.reshape(-1, H))
        x = x + self.down(self.fln(F.gelu(h.float()).type_as(h))).view(b, t, H)
        x = x + self.down2(self.sln(F.gelu(self.up2(x)) + 1.0))
        return self.decoder(self.head_ln(F.gelu(self.dense(x)) + 1.0))


@pytest.mark.parametrize("tp", [2, 4])
def test_norms_within_the_block_keep_it_sharded(tp):
    from parallelizer.passes.cleanup import apply_cleanup
    from parallelizer.passes.norms_over_projections import apply_norms_over_projections
    from parallelizer.passes.tensor_parallel import apply_tensor_parallel
    from tp_check import assert_tp_matches
    torch.manual_seed(0)
    model = SubLayerNorm()
    gm = captured(model, x_batch()).gm
    assert apply_norms_over_projections(gm) == 2  # analyse.py's, at tp > 1
    d = plan_tp(gm.graph, tp)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    assert_tp_matches(model, x_batch(), tp, d, gm)
    assert _sharded(d) == {f"{n}.weight" for n in ("q", "k", "v", "o", "up", "down", "up2",
                                                    "down2")}
    gathered = [r.why for r in d.redistributions if r.kind == "all_gather"]
    assert len(gathered) == 1 and "aten.layer_norm" in gathered[0], gathered
    means = [r for r in d.redistributions if (r.kind, r.reduce_op) == ("all_reduce", "avg")]
    assert len(means) == 4, d.redistributions  # two means each of the written-out norms


def test_kosmos2_text_model_with_sub_layer_norms_is_sharded():
    """The real transformers class (Kosmos-2's text decoder: ``inner_attn_ln`` and
    ``ffn_layernorm``), compiled at tp=2 with the compile's self-check (2 tp ranks against
    the model: outputs and every gradient)."""
    transformers = pytest.importorskip("transformers")
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    cfg = transformers.Kosmos2TextConfig(vocab_size=96, embed_dim=32, layers=1, ffn_dim=64,
                                         attention_heads=4, max_position_embeddings=64,
                                         dropout=0.0, attention_dropout=0.0,
                                         activation_dropout=0.0)
    torch.manual_seed(0)
    from transformers.models.kosmos2.modeling_kosmos2 import Kosmos2TextForCausalLM
    model = Kosmos2TextForCausalLM(cfg).train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    program = compile_module(model, {"input_ids": ids, "labels": ids},
                             Spec.model_validate({"mesh": {"tp": 2}}))
    sharded = {t.fqn for t in program.plan.tensors.values() if t.tp_dim is not None}
    block = "model.layers.0"
    assert {f"{block}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "out")} | {
        f"{block}.ffn.fc1.weight", f"{block}.ffn.fc2.weight"} <= sharded, sorted(sharded)
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes
