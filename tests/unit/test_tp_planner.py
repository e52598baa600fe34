"""Tensor-parallel planner (plan_tp) and the tensor_parallel pass that applies its decision.

Planner tests: which linears become column_parallel / row_parallel, the shape-constant
rewrites, PlanErrors naming ``mesh.tp``, the module and the valid tp degrees, and conflicts
kept replicated *with a reason in the report*. Pass tests: the Megatron f/g structure
(Before / Expected), and numerical equivalence at tp=2 by running the rewritten graph as two
ranks in lockstep in one process (each rank holds its weight shards; ``g`` sums the ranks'
partial results), against the unmodified model.
"""
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from parallelizer.checkpoint.slicing import local_piece
from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.layouts import Fused, InterleavedHeads, ReplicatedHeads
from parallelizer.plan.parallel_plan import TensorPlan
from parallelizer.planning.tp import linear_counts, plan_tp
from parallelizer.runtime.tp import copy_to_tp_region, reduce_from_tp_region

aten = torch.ops.aten
H = 32


def captured(model: nn.Module, batch):
    return capture(model, batch, Path(__file__))


def x_batch(b=2, t=5, seed=0):
    return (torch.randn(b, t, H, generator=torch.Generator().manual_seed(seed)),)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, 64, bias=False)
        self.up = nn.Linear(H, 64, bias=False)
        self.down = nn.Linear(64, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: the attention and MLP live under named submodules."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention()
        self.mlp = SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def ids_batch(b=2, t=8, seed=0):
    return {"input_ids": torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))}


# --- lockstep tp simulation -----------------------------------------------------------------

class _Rank(fx.Interpreter):
    """One tp rank: reads its piece of every sharded weight and bias (the planner's
    ``dims`` and ``layouts``, cut by the checkpoint writer's ``local_piece``)."""

    def __init__(self, gm, rank, tp, decision):
        super().__init__(gm)
        self.rank, self.tp, self.decision = rank, tp, decision

    def get_attr(self, target, args, kwargs):
        t = super().get_attr(target, args, kwargs)
        d = self.decision.dims.get(target)
        if d is None:
            return t
        tplan = TensorPlan(target, tuple(t.shape), "float32", d, (0,),
                           layout=self.decision.layouts.get(target))
        return local_piece(t.detach(), tplan, self.tp, self.rank)


def run_tp_lockstep(gm, decision, tp, args, kwargs=None):
    """Outputs of every rank of the tp-rewritten ``gm``; ``g`` sums the ranks' inputs."""
    ranks = [_Rank(gm, r, tp, decision) for r in range(tp)]
    flat = list(args) + [kwargs[n.target] for n in gm.graph.nodes
                         if kwargs and n.op == "placeholder"]
    for r in ranks:
        r.args_iter, r.env = iter(flat), {}
    outputs = []
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is reduce_from_tp_region:
                total = sum(r.env[node.args[0]] for r in ranks)
                for r in ranks:
                    r.env[node] = total
            elif node.op == "output":
                outputs = [r.run_node(node) for r in ranks]
            else:
                for r in ranks:
                    r.env[node] = r.run_node(node)
    return outputs


# --- planner: which linears ------------------------------------------------------------------

def test_mlp_first_column_second_row():
    cap = captured(MLP(), x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"fc1.weight"} and d.row == {"fc2.weight"}
    assert d.biases == {"fc1.weight": "fc1.bias", "fc2.weight": "fc2.bias"}
    assert d.rewrites == {}
    assert d.report == [] and linear_counts(d) == "column_parallel: 1 linears; row_parallel: 1 linears; replicated: none"

def assert_lockstep_matches(model, gm, decision, x, tp: int = 2):
    """Each simulated tp rank's first output equals the unmodified model's (1e-5)."""
    with torch.no_grad():
        ref = model(*x)
    for out in run_tp_lockstep(gm, decision, tp, x):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)



def test_swiglu_gate_and_up_column_down_row():
    cap = captured(SwiGLU(), x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"gate.weight", "up.weight"} and d.row == {"down.weight"}
    assert d.biases == {}


def test_attention_qkv_column_o_row_heads_constant_rewritten():
    cap = captured(Attention(), x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    views = [n for n in cap.gm.graph.nodes if n.target is aten.view.default]
    assert [list(v.args[1])[2] for v in views] == [4, 4, 4]
    assert {v.name: d.rewrites[v.name] for v in views} == {v.name: [(1, 2, 2)] for v in views}
    merge = next(n for n in cap.gm.graph.nodes if n.target is aten.reshape.default)
    assert d.rewrites[merge.name] == [(1, 2, H // 2)]                 # hidden 32 -> 16
    assert set(d.rewrites) == {v.name for v in views} | {merge.name}


@pytest.mark.parametrize("model_cls", [MLP, SwiGLU, Attention, Block])
def test_tp1_shards_nothing(model_cls):
    cap = captured(model_cls(), x_batch())
    d = plan_tp(cap.gm.graph, 1)
    assert d.column == set() and d.row == set() and d.rewrites == {} and d.report == []
    assert apply_tensor_parallel(cap.gm, d) is False


def test_block_pairs_attention_and_mlp_separately():
    cap = captured(Block(), x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"attn.q.weight", "attn.k.weight", "attn.v.weight",
                        "mlp.gate.weight", "mlp.up.weight"}
    assert d.row == {"attn.o.weight", "mlp.down.weight"}


def test_tp_not_dividing_heads_is_a_plan_error():
    cap = captured(Block(), x_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 3)
    msg = str(e.value)
    assert msg.startswith("mesh.tp (3) must divide the number of heads (4) of attn ")
    assert msg.endswith("valid choices: tp in {1, 2, 4}")


# --- planner: GQA (transformers' LlamaForCausalLM, 4 heads, 2 kv heads) ----------------------

@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, captured(model, ids_batch())


def test_gqa_tp2_rewrites_repeat_kv_constants(llama):
    model, cap = llama
    d = plan_tp(cap.gm.graph, 2)
    for i in range(2):
        p = f"model.layers.{i}."
        assert {p + f"self_attn.{x}_proj.weight" for x in "qkv"} | \
               {p + f"mlp.{x}_proj.weight" for x in ("gate", "up")} <= d.column
        assert {p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"} <= d.row
    assert "lm_head.weight" not in d.column | d.row
    assert "replicated linear: lm_head.weight (no column/row pair found; aten.linear.default at " \
           "modeling_llama.py:" in "\n".join(d.report)
    # kv projections split evenly are marked as heads (a converter may copy them for tp > 2)
    kv = InterleavedHeads(2, 8)
    assert d.layouts == {f"model.layers.{i}.self_attn.{x}_proj.weight": kv
                         for i in range(2) for x in "kv"}
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    expands = [n for n in cap.gm.graph.nodes if n.target is aten.expand.default and n.name in d.rewrites]
    reshapes = [n for n in cap.gm.graph.nodes if n.target is aten.reshape.default and n.name in d.rewrites]
    # repeat_kv: expand (B, kv=2, n_rep=2, T, hd) -> kv 1; reshape (B, heads=4, T, hd) -> 2
    assert len(expands) == 4 and len(reshapes) == 4       # k and v, two layers
    for n in expands:
        assert list(n.args[1])[1] == 2 and d.rewrites[n.name] == [(1, 1, 1)]
    for n in reshapes:
        assert list(n.args[1])[1] == 4 and d.rewrites[n.name] == [(1, 1, 2)]
    assert all(name in by_name for name in d.rewrites)


def test_gqa_tp4_replicates_kv_heads(llama):
    """tp (4) > kv heads (2): k/v_proj keep one whole kv head per rank (replicated_heads,
    ranks 0,1 head 0 and ranks 2,3 head 1); repeat_kv's expand becomes (B, 1, 1, T, hd) and
    its reshape (B, 1, T, hd): each rank's query head uses its own kv head."""
    model, cap = llama
    d = plan_tp(cap.gm.graph, 4)
    kv = ReplicatedHeads(2, 8)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        assert {p + f"{x}_proj.weight" for x in "qkv"} <= d.column
        assert d.layouts[p + "k_proj.weight"] == kv and d.layouts[p + "v_proj.weight"] == kv
        assert p + "q_proj.weight" not in d.layouts
    assert set(d.layouts) == {f"model.layers.{i}.self_attn.{x}_proj.weight"
                              for i in range(2) for x in "kv"}
    expands = [n for n in cap.gm.graph.nodes if n.target is aten.expand.default and n.name in d.rewrites]
    reshapes = [n for n in cap.gm.graph.nodes if n.target is aten.reshape.default and n.name in d.rewrites]
    assert len(expands) == 4 and len(reshapes) == 4
    for n in expands:
        assert list(n.args[1])[1:3] == [2, 2] and d.rewrites[n.name] == [(1, 1, 1), (1, 2, 1)]
    for n in reshapes:
        assert list(n.args[1])[1] == 4 and d.rewrites[n.name] == [(1, 1, 1)]
    assert any(line.startswith("layout replicated_heads (2 heads of 8") for line in d.report)


def test_gqa_tp3_plan_error(llama):
    """3 divides neither the 2 kv heads nor is a multiple of them (nor divides 4 heads)."""
    _, cap = llama
    with pytest.raises(PlanError, match=r"mesh.tp \(3\) must divide .*valid choices: tp in \{1, 2, 4\}"):
        plan_tp(cap.gm.graph, 3)


def test_gqa_kv_heads_neither_divided_nor_replicable_plan_error():
    """6 heads, 2 kv heads, tp 3: 3 divides the heads but neither divides the kv heads nor
    is a multiple of them; the error names the module, both numbers and the valid tps."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    cap = captured(transformers.LlamaForCausalLM(cfg).eval(), ids_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 3)
    msg = str(e.value)
    assert msg.startswith("mesh.tp (3) must divide the number of kv heads (2) of "
                          "model.layers.0.self_attn ("), msg
    assert "or be a multiple of it (each kv head is then held by tp / kv heads ranks)" in msg
    assert msg.endswith("valid choices: tp in {1, 2, 6}"), msg


# --- planner: ops without a sharding rule ----------------------------------------------------

class TwoMLPs(nn.Module):
    """First MLP has ``op`` between its column and row linear; the second is clean."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.first, self.second = MLP(), MLP()

    def forward(self, x):
        h = self.first.fc2(self.op(self.first.fc1(x)))
        return self.second(h)


def _line_of(code: str) -> int:
    """Line number of ``code`` in this file (the source line a report names)."""
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if code in text and "_line_of(" not in text)


def _conflict_plan(op):
    cap = captured(TwoMLPs(op), x_batch())
    return plan_tp(cap.gm.graph, 2)


def test_cumsum_between_pair_keeps_it_replicated_and_reports_why():
    d = _conflict_plan(lambda h: torch.cumsum(h, dim=-1))
    assert d.column == {"second.fc1.weight"} and d.row == {"second.fc2.weight"}
    kept = [line for line in d.report if line.startswith("kept replicated:")]
    line = _line_of("h = self.first.fc2(self.op(self.first.fc1(x)))")
    assert kept == ["kept replicated: first.fc1.weight, first.fc2.weight (at cumsum = "
                    f"aten.cumsum.default at test_tp_planner.py:{line} in the root module: "
                    "aten.cumsum.default cannot take a sharded input here (DTensor's strategy "
                    "would redistribute it))"]


def test_dtensor_strategy_shards_an_op_our_table_lacks():
    """cumsum over the sequence (dim 1) keeps the feature shard: our table has no cumsum
    rule, DTensor's scan strategy says Shard(2) in, Shard(2) out; both pairs shard and the
    ranks equal the unmodified model."""
    torch.manual_seed(0)
    model = TwoMLPs(lambda h: torch.cumsum(h, dim=1)).eval()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"first.fc1.weight", "second.fc1.weight"}
    assert d.row == {"first.fc2.weight", "second.fc2.weight"}
    apply_tensor_parallel(cap.gm, d)
    x = x_batch(3, 7, seed=1)
    assert_lockstep_matches(model, cap.gm, d, x)


def test_sort_between_pair_keeps_it_replicated():
    d = _conflict_plan(lambda h: torch.sort(h, dim=-1).values)
    assert d.column == {"second.fc1.weight"} and d.row == {"second.fc2.weight"}
    assert any(line.startswith("kept replicated: first.fc1.weight, first.fc2.weight")
               for line in d.report)


def test_sort_between_pair_report_names_sort():
    d = _conflict_plan(lambda h: torch.sort(h, dim=-1).values)
    kept = next(line for line in d.report if line.startswith("kept replicated:"))
    assert "sort" in kept


def test_max_over_sharded_hidden_is_not_silently_sharded():
    class MaxSideBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(F.gelu(h)) + h.max(dim=-1, keepdim=True).values

    torch.manual_seed(0)
    model = MaxSideBranch().eval()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2, allow_replicated=True)
    apply_tensor_parallel(cap.gm, d)
    x = x_batch(3, 7, seed=1)
    with torch.no_grad():
        ref = model(*x)
    # today: each rank is off by up to ~0.9, and the two ranks disagree
    for out in run_tp_lockstep(cap.gm, d, 2, x):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    assert any("max" in line for line in d.report if line.startswith("kept replicated:"))


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
    outs = run_tp_lockstep(cap.gm, d, 2, x)
    for out in outs:
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


def test_tp2_gqa_llama_matches_unmodified_model(llama):
    model, _ = llama
    cap = captured(model, ids_batch())       # fresh capture: the pass rewrites in place
    d = plan_tp(cap.gm.graph, 2)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    batch = ids_batch(3, 11, seed=1)
    with torch.no_grad():
        ref = model(**batch).logits
    outs = run_tp_lockstep(cap.gm, d, 2, (), batch)
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
    assert d.dims == {"w1": 0, "b1": 0, "w2": 0} and d.biases == {"w1": "b1", "w2": "b2"}
    assert any(line.startswith("replicated linear: w3 (no column/row pair found; aten.mm.default "
                               "at test_tp_planner.py:") for line in d.report), d.report
    apply_tensor_parallel(cap.gm, d)
    g = next(n for n in cap.gm.graph.nodes if n.target is reduce_from_tp_region)
    assert g.args[0].target is aten.matmul.default and [u.target for u in g.users] == [aten.add.Tensor]
    x = (torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)),)
    assert_lockstep_matches(model, cap.gm, d, x)


def _nothing_shardable():
    return captured(nn.Sequential(nn.Linear(H, 64), _Cumsum(), nn.Linear(64, H)), x_batch())


def test_tp_that_shards_nothing_is_a_plan_error_naming_the_op():
    """The only pair has a cumsum over the sharded features: nothing could be sharded, so
    tp=2 would only add all-reduces; the error names the op, its source line and the key."""
    cap = _nothing_shardable()
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 2)
    msg = str(e.value)
    line = _line_of("torch.cumsum(h, dim=-1)  # the blocking op")
    assert msg.startswith("mesh.tp=2 but no weight matrix could be sharded; the first op that "
                          f"stopped it: aten.cumsum.default at test_tp_planner.py:{line} in 1: "
                          "aten.cumsum.default cannot take a sharded input here (DTensor's "
                          "strategy would redistribute it)."), msg
    assert "tensor_parallel.allow_replicated=true" in msg and "mesh.tp=1" in msg


def test_tp_that_shards_nothing_allowed_warns():
    cap = _nothing_shardable()
    decision = plan_tp(cap.gm.graph, 2, allow_replicated=True)
    assert not decision.column and not decision.row
    assert len(decision.warnings) == 1
    assert decision.warnings[0].startswith("mesh.tp=2 but no weight matrix could be sharded "
                                           "(the first op that stopped it: aten.cumsum.default")
    assert not plan_tp(cap.gm.graph, 1).warnings


class _Cumsum(nn.Module):
    def forward(self, h):
        return torch.cumsum(h, dim=-1)  # the blocking op


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
    for out in run_tp_lockstep(cap.gm, d, tp, (), batch):
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
    for out in run_tp_lockstep(cap.gm, d, tp, (), batch):
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


# --- the compile's tp summary line and the nothing-sharded error (the real CLI, in process) --

_BLOCKS_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(BETWEEN(self.fc1(self.ln(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x.mean()


def build_model():
    return Model()


def example_inputs():
    return (torch.randn(2, 4, 8),)
'''


def _compile_cli(tmp_path, capsys, between, *overrides):
    from parallelizer.cli import parallelize as cli
    model = tmp_path / "model.py"
    model.write_text(_BLOCKS_MODEL.replace("BETWEEN", between))
    spec = tmp_path / "spec.yaml"
    spec.write_text("mesh: {tp: 2}\n")
    code = cli.main([str(model), str(spec), "-o", str(tmp_path / "out"), "--no-weights",
                     *overrides])
    return code, capsys.readouterr()


def test_compile_prints_tp_summary_line(tmp_path, capsys):
    code, io = _compile_cli(tmp_path, capsys, "torch.relu")
    assert code == 0, io.err
    # sharded: 4 block matrices of 2048 and the two fc1 biases
    sharded = 4 * 2048 + 2 * 64
    total = sharded + 2 * 32 + 8 * 32 + 32 + 2 * 64  # + 2 LayerNorms
    assert f"tensor parallel: 4 of 4 weight matrices in blocks sharded " \
           f"({100 * sharded / total:.0f} % of parameters)" in io.out.splitlines()
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- tensor parallel: 4 of 4 weight matrices in blocks sharded" in report


def test_compile_with_nothing_sharded_exits_2_naming_the_op(tmp_path, capsys):
    code, io = _compile_cli(tmp_path, capsys, "(lambda h: torch.cumsum(h, -1))")
    assert code == 2
    assert io.err.startswith("error: mesh.tp=2 but no weight matrix could be sharded; the first "
                             "op that stopped it: aten.cumsum.default at model.py:12 in "
                             "blocks.0: aten.cumsum.default cannot take a sharded input here "
                             "(DTensor's strategy would redistribute it)."), io.err
    assert "tensor_parallel.allow_replicated=true" in io.err
    assert not (tmp_path / "out").exists()
    code, io = _compile_cli(tmp_path, capsys, "(lambda h: torch.cumsum(h, -1))",
                            "tensor_parallel.allow_replicated=true")
    assert code == 0, io.err
    assert "tensor parallel: 0 of 4 weight matrices in blocks sharded (0 % of parameters)" in io.out
    assert "warning: mesh.tp=2 but no weight matrix could be sharded" in io.err
