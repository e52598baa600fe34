"""Any weight path (issue 23, part 4): linears whose weight is cast, viewed or transposed
before the matmul are found by their algebra and sharded Megatron-style; the tp ranks run
in lockstep in one process (tests/tp_lockstep.py) and give the unmodified model's outputs,
every gradient and the parameters after one SGD step (fp32, 1e-5).
Models: tests/tp_weight_path_models.py; the check: tests/tp_check.py."""
from __future__ import annotations

import pytest
import torch

from parallelizer.analysis.linears import as_linear
from parallelizer.plan.layouts import Fused, ReplicatedHeads
from tp_check import plan_and_check
from tp_small_models import captured
from tp_weight_path_models import CastNet, LoRANet, SplitQKVNet, TiedVONet, x_batch

MODES = ["to", "type_as", "view", "io", "matmul_to", "float_T"]


@pytest.mark.parametrize("mode", MODES)
def test_linear_found_through_casts_views_and_transposes(mode):
    torch.manual_seed(0)
    cap = captured(CastNet(mode), x_batch())
    sites = {s.weight: s for s in map(as_linear, cap.gm.graph.nodes) if s is not None}
    assert len(sites) == 12, sorted(sites)
    up = sites["layers.0.up.weight"]
    assert up.bias == "layers.0.up.bias" and up.param.target == up.weight
    assert up.out_dim == (1 if mode == "io" else 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_cast_weights_shard_column_row_and_match(mode, tp):
    torch.manual_seed(0)
    model = CastNet(mode)
    d = plan_and_check(model, x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + f"attn.{n}.weight" for n in "qkv"} | {p + "up.weight"} <= d.column
        assert {p + "attn.o.weight", p + "down.weight"} <= d.row
    assert d.dims["layers.0.up.weight"] == (1 if mode == "io" else 0)
    assert d.dims["layers.0.up.bias"] == 0


@pytest.mark.parametrize("kv, tp", [(2, 2), (4, 4), (4, 2)])
def test_fused_qkv_split_by_sizes_with_per_head_gains(kv, tp):
    """``torch.split(qkv, [q, k, v])`` with unequal sizes (GQA), then a learned gain per
    query head and per kv head: the fused weight is column_parallel per part (each rank
    holds its block of q, of k and of v), the gains are sharded along their heads (they
    were refused: "aten.mul.Tensor cannot take a sharded input here"), and the ranks match."""
    torch.manual_seed(0)
    d = plan_and_check(SplitQKVNet(kv), x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert p + "qkv.weight" in d.column and p + "o.weight" in d.row
        assert d.layouts[p + "qkv.weight"] == Fused((32, 8 * kv, 8 * kv))
        assert d.per_head[p + "q_gain"] == d.per_head[p + "k_gain"] == 0


def test_per_kv_head_gain_at_tp_above_kv_heads_copies_the_kv_parts():
    """At tp 4 with 2 kv heads the k and v parts of the fused q|k|v are copies (each rank
    holds its query heads and its kv head, decision 75); the gain per kv head is cut to each
    rank's copy on its edge (``scatter_copies``), the gain per query head sharded along
    heads, and the ranks match. (Before: the fused q|k|v computed whole on every rank, and
    before that the whole attention replicated.)"""
    torch.manual_seed(0)
    d = plan_and_check(SplitQKVNet(2), x_batch(3, 5, seed=1), 4)
    copies = ReplicatedHeads(2, 8)
    for i in range(2):
        p = f"layers.{i}."
        assert p + "qkv.weight" in d.column and p + "o.weight" in d.row
        assert d.layouts[p + "qkv.weight"] == Fused((32, 16, 16), (None, copies, copies))
        assert d.per_head[p + "q_gain"] == 0
    assert [r.kind for r in d.redistributions] == ["scatter_copies", "scatter_copies"]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_weight_read_as_column_and_transposed_as_row_is_kept_whole(tp):
    """v's weight is the value projection's and, transposed, the output projection's. Put in
    the row set for the second reader, the pass rewrote the first as a row linear too (each
    rank's (T, H/tp) input against the (H/tp, H) piece: a shape error at compile). It is kept
    whole, its attention cut to each rank's heads, q and k sharded."""
    torch.manual_seed(0)
    d = plan_and_check(TiedVONet(), x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + "q.weight", p + "k.weight"} <= d.column
        assert p + "v.weight" not in d.column | d.row
        assert any(line.startswith(f"kept whole: {p}v.weight (read by two linears along "
                                   f"different dims") for line in d.report), d.report


@pytest.mark.parametrize("adapter_first", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_lora_base_linears_are_the_megatron_pairs(adapter_first, tp):
    """``base(h) + 2 * B(A(h))`` (peft's LoRA): the add merges two linear maps of one input,
    not the residual stream. The walk stopped there and paired A (column) with B (row), and
    the base linears, most of the parameters, stayed replicated (a break test: 46 % of the
    parameters sharded). Now the bases are the Megatron pairs; on a column base B is a
    column too and A whole (its rank dim uncut); on a row base A is a row and B whole, applied
    to the Partial before the all-reduce (as Megatron-core's LoRA adapters are laid out).
    Either order of the add; the ranks match."""
    torch.manual_seed(0)
    d = plan_and_check(LoRANet(adapter_first), x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + f"{m}.base.weight" for m in ("q", "v", "up")} | {p + "k.weight"} \
            | {p + f"{m}.B" for m in ("q", "v", "up")} <= d.column
        assert {p + f"{m}.base.weight" for m in ("o", "down")} | {p + f"{m}.A" for m in ("o", "down")} <= d.row
        assert not ({p + f"{m}.A" for m in ("q", "v", "up")} | {p + f"{m}.B" for m in ("o", "down")}) \
            & (d.column | d.row)
    assert any("replicated linear: layers.0.q.A (feeds only column_parallel layers.0.q.B" in line
               for line in d.report), d.report
    assert any("replicated linear: layers.0.o.B (reads the Partial output of row_parallel "
               "layers.0.o.A" in line for line in d.report), d.report


def test_lora_with_frozen_bases_matches():
    """The same with the bases frozen (LoRA fine-tuning): only A and B have gradients."""
    torch.manual_seed(0)
    d = plan_and_check(LoRANet(frozen=True), x_batch(3, 5, seed=1), 2)
    assert "layers.1.up.base.weight" in d.column and "layers.1.down.base.weight" in d.row


class _FlatUp(torch.nn.Module):
    """An MLP whose up weight is stored flat and viewed to (4d, d) before F.linear."""

    def __init__(self, d=16):
        super().__init__()
        self.d = d
        self.w_up = torch.nn.Parameter(0.05 * torch.randn(4 * d * d))
        self.down = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        up = torch.nn.functional.linear(x, self.w_up.view(4 * self.d, self.d))
        return x + self.down(torch.nn.functional.gelu(up))


def test_a_flat_weight_viewed_as_the_matrix_is_named_not_left_silent():
    """A 1-D parameter viewed as a linear's weight is not sharded (its row split would be
    strided): it was in no report line and the refusal named nothing (a break test); now
    report.md and the refusal name it, with the fix."""
    from parallelizer.errors import PlanError
    from parallelizer.planning.tp import plan_tp
    torch.manual_seed(0)
    gm = captured(_FlatUp(), (torch.randn(2, 5, 16),)).gm
    d = plan_tp(gm.graph, 2, allow_replicated=True)
    line = d.other_replicated["w_up"]
    assert line.startswith("replicated: w_up (1024, flat, read by aten.linear.default at "
                           "test_weight_paths.py:") and line.endswith("store it 2-D)"), line
    with pytest.raises(PlanError, match=r"no weight matrix could be sharded; .*; w_up \(1024, flat"):
        plan_tp(gm.graph, 2)


class _ConcatenatedBiases(torch.nn.Module):
    """q and k projections applied with their biases concatenated and cut again (WavLM's
    call of ``F.multi_head_attention_forward``), then an MLP the planner can pair."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        bq, bk = torch.cat([self.q.bias, self.k.bias]).chunk(2)
        q = torch.nn.functional.linear(x, self.q.weight, bq)
        k = torch.nn.functional.linear(x, self.k.weight, bk)
        h = x + torch.softmax(q @ k.transpose(1, 2), -1) @ x
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def test_a_linear_with_a_computed_bias_is_taken_as_one():
    """WavLM's q, k and v projections were reported "read by aten.linear.default: no
    tensor-parallel rule splits a weight this op reads" (a held-out zoo), then "a product
    whose bias is computed": a linear, told it is not one. A bias computed in forward no
    longer hides the linear (a column's is cut by its layout, tests/unit/planning/
    test_tp_computed_bias.py); here q and k, whose product ``q @ k^T`` no row linear reads,
    are replicated linears for that reason, and every rank equals the model."""
    from tp_check import assert_tp_matches, planned
    torch.manual_seed(0)
    model, batch = _ConcatenatedBiases(), (torch.randn(2, 5, 16),)
    gm, d = planned(model, batch, 2)
    assert "up.weight" in d.column and "down.weight" in d.row
    assert "q.weight" in d.linears and "q.weight" not in d.other_replicated, d.other_replicated
    assert any(line.startswith("replicated linear: q.weight (no column/row pair found; "
                               "aten.linear.default at test_weight_paths.py:")
               for line in d.report), d.report
    assert_tp_matches(model, batch, 2, d, gm)


class _NoGradThenGrad(torch.nn.Module):
    """A block run once under ``torch.no_grad()`` and again with gradients (HRM's first
    cycles, a held-out zoo): capture inlines the no_grad region with every parameter read
    through ``detach``, a weight path the planner did not follow, so that copy of the block
    read the rank's shard of its weights as a replicated linear (a shape error at tp2, a wrong
    forward in transformers' HRM that only the self-check caught). ``detach`` is a cast of the
    weight now: both calls are the same column/row pair."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def block(self, x):
        return x + self.down(torch.relu(self.up(x)))

    def forward(self, x):
        with torch.no_grad():
            z = self.block(x)
        return self.block(z + x)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_block_called_under_no_grad_and_with_grad_is_one_pair(tp):
    torch.manual_seed(0)
    d = plan_and_check(_NoGradThenGrad(), (torch.randn(2, 5, 16),), tp)
    assert d.column == {"up.weight"} and d.row == {"down.weight"}, (d.column, d.row)
