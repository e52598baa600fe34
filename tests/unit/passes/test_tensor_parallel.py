"""The tensor_parallel pass (passes/tensor_parallel.py) applying the planner's decision:
the f/g operators it inserts (Before / Expected), and the rewritten graph's numerics at
tp = 2 and 4 on lockstep ranks (tests/tp_lockstep.py) against the unmodified model, for
nanoGPT-style blocks, Llama's GQA, GPT-2's Conv1D and fused q|k|v, Phi-3 and GPT-NeoX.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.layouts import Fused, InterleavedHeads
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime.tp import copy_to_tp_region, reduce_from_tp_region
from tp_lockstep import assert_lockstep_matches, forward_ranks
from tp_small_models import (H, Attention, Block, MLP, SwiGLU, captured, ids_batch, line_of,
                             tiny_llama, x_batch)

aten = torch.ops.aten


# --- tensor_parallel pass: structure (Before / Expected) -------------------------------------

def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_inserts_f_before_column_and_g_after_row_bias_added_once():
    cap = captured(MLP(), x_batch())
    gm = cap.gm
    assert apply_tensor_parallel(gm, plan_tp(gm.graph, 2)) is True
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    f, fc1, gelu, fc2, g, add = _calls(gm)
    # Expected:
    #   f = copy_to_tp_region(x); fc1 = linear(f, fc1.weight, fc1.bias); gelu
    #   fc2 = linear(gelu, fc2.weight); g = reduce_from_tp_region(fc2); add(g, fc2.bias)
    assert f.target is copy_to_tp_region and f.args == (x,)
    assert fc1.target is aten.linear.default and fc1.args[0] is f
    assert [a.target for a in fc1.args[1:]] == ["fc1.weight", "fc1.bias"]
    assert gelu.target is aten.gelu.default
    assert fc2.target is aten.linear.default and [a.target for a in fc2.args[1:]] == ["fc2.weight"]
    assert g.target is reduce_from_tp_region and g.args == (fc2,)
    assert add.target is aten.add.Tensor and add.args[0] is g and add.args[1].target == "fc2.bias"
    assert gm.graph.output_node().args[0] == (add,)
    assert "copy_to_tp_region" in gm.code and "reduce_from_tp_region" in gm.code


@pytest.mark.parametrize("model_cls, n_column", [(SwiGLU, 2), (Attention, 3)])
def test_pass_shares_one_f_between_columns_reading_one_input(model_cls, n_column):
    cap = captured(model_cls(), x_batch())
    gm = cap.gm
    d = plan_tp(gm.graph, 2)
    apply_tensor_parallel(gm, d)
    fs = [n for n in _calls(gm) if n.target is copy_to_tp_region]
    gs = [n for n in _calls(gm) if n.target is reduce_from_tp_region]
    assert len(fs) == 1 and len(gs) == 1
    users = [u for u in fs[0].users]
    assert len(users) == n_column and all(u.args[1].target in d.column for u in users)
    # constants rewritten in the graph itself
    for name, edits in d.rewrites.items():
        node = next(n for n in gm.graph.nodes if n.name == name)
        for arg, i, new in edits:
            assert node.args[arg][i] == new


# --- tensor_parallel pass: numerics at tp=2 (lockstep ranks) ---------------------------------

@pytest.mark.parametrize("model_cls", [MLP, SwiGLU, Attention, Block])
def test_tp2_rewrite_matches_unmodified_model(model_cls):
    torch.manual_seed(0)
    model = model_cls().eval()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    x = x_batch(3, 7, seed=1)
    with torch.no_grad():
        ref = model(*x)
    outs = forward_ranks(cap.gm, d, 2, list(x))
    for out in outs:
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, captured(model, ids_batch())


def test_tp2_gqa_llama_matches_unmodified_model(llama):
    model, _ = llama
    cap = captured(model, ids_batch())       # fresh capture: the pass rewrites in place
    d = plan_tp(cap.gm.graph, 2)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    batch = ids_batch(3, 11, seed=1)
    with torch.no_grad():
        ref = model(**batch).logits
    outs = forward_ranks(cap.gm, d, 2, list(batch.values()))
    for out in outs:
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


class Conv1DMLP(torch.nn.Module):
    """Two transformers-style Conv1D layers: ``addmm(bias, x, W)`` with W stored (in, out)."""

    def __init__(self, bias=True):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 32))
        self.w2 = torch.nn.Parameter(torch.randn(32, 16))
        self.b1 = torch.nn.Parameter(torch.randn(32)) if bias else None
        self.b2 = torch.nn.Parameter(torch.randn(16)) if bias else None

    def forward(self, x):
        if self.b1 is None:
            return (x.reshape(-1, 16) @ self.w1).relu() @ self.w2
        h = torch.addmm(self.b1, x.reshape(-1, 16), self.w1).relu()
        return torch.addmm(self.b2, h, self.w2)


def test_conv1d_addmm_pair_is_column_then_row_on_transposed_dims():
    """Conv1D's weight is (in, out): column_parallel shards dim 1 (and the bias), row_parallel
    dim 0; nothing to warn about."""
    cap = captured(Conv1DMLP(), (torch.randn(4, 16),))
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"w1"} and d.row == {"w2"} and not d.warnings
    assert d.dims == {"w1": 1, "b1": 0, "w2": 0} and d.layouts == {}


class AlgebraMLP(torch.nn.Module):
    """Linears written as algebra: ``x @ W.T + b`` (Falcon's FalconLinear), ``x @ W`` with W
    (in, out), ``torch.mm`` of a ``W.t()``; no aten.linear in the graph."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(32, 16)), nn.Parameter(torch.randn(32))
        self.w2, self.b2 = nn.Parameter(torch.randn(32, 24)), nn.Parameter(torch.randn(24))
        self.w3 = nn.Parameter(torch.randn(16, 24))

    def forward(self, x):
        h = F.gelu(x @ self.w1.T + self.b1)
        h = h @ self.w2 + self.b2                       # row: its bias is added after g
        h = torch.mm(h.reshape(-1, 24), self.w3.t())    # a lone linear: no pair, replicated
        return h


def test_linears_found_by_algebra_pair_and_match():
    torch.manual_seed(0)
    model = AlgebraMLP()
    cap = captured(model, (torch.randn(2, 5, 16),))
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"w1"} and d.row == {"w2"}
    assert d.dims == {"w1": 0, "b1": 0, "w2": 0} and d.biases == {"b1": "w1", "b2": "w2"}
    assert any(line.startswith("replicated linear: w3 (no column/row pair found; aten.mm.default "
                               "at test_tensor_parallel.py:") for line in d.report), d.report
    apply_tensor_parallel(cap.gm, d)
    g = next(n for n in cap.gm.graph.nodes if n.target is reduce_from_tp_region)
    assert g.args[0].target is aten.matmul.default and [u.target for u in g.users] == [aten.add.Tensor]
    x = (torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)),)
    assert_lockstep_matches(model, cap.gm, d, x)


def _nothing_shardable():
    return captured(nn.Sequential(nn.Linear(H, 64), _Cumsum(), nn.Linear(64, H)), x_batch())


def test_tp_that_shards_nothing_is_a_plan_error_naming_the_op(in_place_kept):
    """The only pair has an in-place cumsum over the sharded features (no gathered copy can
    stand in for a value written in place): nothing could be sharded, so tp=2 would only
    add all-reduces; the error names the op, its source line, why, and the key."""
    cap = _nothing_shardable()
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 2)
    msg = str(e.value)
    line = line_of(__file__, "h.cumsum_(dim=-1)  # the blocking op")
    assert msg.startswith("mesh.tp=2 but no weight matrix could be sharded; the first op that "
                          f"stopped it: aten.cumsum_.default at test_tensor_parallel.py:{line} in 1: "
                          "no sharding rule for aten.cumsum_.default (ours or DTensor's); it "
                          "writes into its sharded input in place, which no gathered copy can "
                          "stand in for."), msg
    assert "tensor_parallel.allow_replicated=true" in msg and "mesh.tp=1" in msg


def test_tp_that_shards_nothing_allowed_warns(in_place_kept):
    cap = _nothing_shardable()
    decision = plan_tp(cap.gm.graph, 2, allow_replicated=True)
    assert not decision.column and not decision.row
    assert len(decision.warnings) == 1
    assert decision.warnings[0].startswith("mesh.tp=2 but no weight matrix could be sharded "
                                           "(the first op that stopped it: aten.cumsum_.default")
    assert not plan_tp(cap.gm.graph, 1).warnings


class _Cumsum(nn.Module):
    def forward(self, h):
        return h.cumsum_(dim=-1)  # the blocking op


# --- GPT-2 (transformers' GPT2LMHeadModel: Conv1D, fused q|k|v in c_attn) --------------------

def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=H, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=63, eos_token_id=63,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def test_gpt2_c_attn_fused_column_c_proj_row(gpt2):
    cap = captured(gpt2, ids_batch())
    d = plan_tp(cap.gm.graph, 2)
    fused = Fused((H, H, H))
    for i in range(2):
        p = f"transformer.h.{i}."
        assert {p + "attn.c_attn.weight", p + "mlp.c_fc.weight"} <= d.column
        assert {p + "attn.c_proj.weight", p + "mlp.c_proj.weight"} <= d.row
        assert d.dims[p + "attn.c_attn.weight"] == 1 and d.dims[p + "attn.c_attn.bias"] == 0
        assert d.dims[p + "attn.c_proj.weight"] == 0 and p + "attn.c_proj.bias" not in d.dims
        assert d.layouts[p + "attn.c_attn.weight"] == d.layouts[p + "attn.c_attn.bias"] == fused
    assert len(d.layouts) == 4 and not d.warnings
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    splits = [by_name[n] for n in d.rewrites if by_name[n].target is aten.split.Tensor]
    assert len(splits) == 2 and all(d.rewrites[n.name] == [(1, None, H // 2)] for n in splits)
    # the (B, T, 3H) view of c_attn's output becomes (B, T, 3H / 2)
    views = [n for n in d.rewrites if by_name[n].target is aten.view.default
             and list(by_name[n].args[1])[-1] == 3 * H]
    assert len(views) == 2 and all(d.rewrites[n] == [(1, 2, 3 * H // 2)] for n in views)


@pytest.mark.parametrize("tp", [4])  # tp=2 (with pp=2) runs in tests/distributed
def test_gpt2_tp_matches_unmodified_model(gpt2, tp):
    cap = captured(gpt2, ids_batch())
    d = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    assert not any(n.target is aten.addmm.default and n.args[2].target.endswith("c_proj.weight")
                   for n in cap.gm.graph.nodes if n.op == "call_function")
    batch = ids_batch(3, 11, seed=1)
    with torch.no_grad():
        ref = gpt2(**batch).logits
    for out in forward_ranks(cap.gm, d, tp, list(batch.values())):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


# --- other fused layouts: Phi-3 (qkv sliced, GQA parts; gate_up chunked), GPT-NeoX ----------

def _tp_matches(model, tp):
    """Rewrite a fresh capture at ``tp``; every lockstep rank's logits equal the model's."""
    cap = captured(model, ids_batch())
    d = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    batch = ids_batch(3, 11, seed=1)
    with torch.no_grad():
        ref = model(**batch).logits
    for out in forward_ranks(cap.gm, d, tp, list(batch.values())):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    return d


def test_phi3_fused_qkv_slices_and_gate_up_tp2():
    """Phi-3 slices qkv_proj's output at q | k | v (4 heads, 2 kv heads of 8: parts
    [32, 16, 16]) and chunks gate_up_proj's in two: both become fused column weights."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Phi3Config(
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = _tp_matches(transformers.Phi3ForCausalLM(cfg).eval(), 2)
    for i in range(2):
        p = f"model.layers.{i}."
        assert d.layouts[p + "self_attn.qkv_proj.weight"] == Fused((32, 16, 16))
        assert d.layouts[p + "mlp.gate_up_proj.weight"] == Fused((64, 64))
        assert {p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"} <= d.row


def test_gpt_neox_interleaved_qkv_tp2():
    """GPT-NeoX views query_key_value's output as (B, T, heads, 3 * head_dim) and chunks the
    last dim: the even split is head-aligned, recorded as interleaved_heads."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, use_cache=False,
        attn_implementation="sdpa", hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = _tp_matches(transformers.GPTNeoXForCausalLM(cfg).eval(), 2)
    layout = InterleavedHeads(4)
    for i in range(2):
        p = f"gpt_neox.layers.{i}.attention.query_key_value."
        assert d.layouts[p + "weight"] == d.layouts[p + "bias"] == layout
