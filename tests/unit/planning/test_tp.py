"""Tensor-parallel planner (planning/tp.py): which linears become column_parallel /
row_parallel, the shape-constant rewrites, GQA kv heads (divided or copied), ops without a
sharding rule, linears found by their algebra, and the compile's summary line and
nothing-sharded error.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.layouts import InterleavedHeads, ReplicatedHeads
from parallelizer.planning.tp import plan_tp
from parallelizer.planning.tp_matrices import linear_counts
from tp_lockstep import assert_lockstep_matches, forward_ranks
from tp_small_models import (H, Attention, Block, MLP, SwiGLU, captured, ids_batch, line_of,
                             tiny_llama, x_batch)

aten = torch.ops.aten


# --- planner: which linears ------------------------------------------------------------------

def test_mlp_first_column_second_row():
    cap = captured(MLP(), x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"fc1.weight"} and d.row == {"fc2.weight"}
    assert d.biases == {"fc1.bias": "fc1.weight", "fc2.bias": "fc2.weight"}
    assert d.rewrites == {}
    (line,) = d.report
    assert line.startswith("summed over tp every step (Megatron's g): 1 row_parallel output(s), "
                           "320 elements on the example batch; the largest 2x5x32 = 320, of "
                           "fc2.weight (aten.linear.default at tp_small_models.py:"), line
    assert linear_counts(d) == "column_parallel: 1 linears; row_parallel: 1 linears; replicated: none"

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
    assert "valid choices: tp in {1, 2, 4} (sharding every group)" in msg, msg



class OneLinearBlocks(nn.Module):
    """Blocks of one linear each, ``x + tanh(lin(x))``: a linear reaches the next only past
    a residual add, a block's end."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


def test_no_pair_past_residual_adds_says_so():
    """With no pair and no other end in the way, the refusal said "no linear layer feeds
    another", false where one linear feeds the next past a block's end (and where two
    branches' add was taken for one, zoo 23 F4); it names such a linear and the one it
    reaches."""
    with pytest.raises(PlanError, match=r"no column/row pair was found: each linear's output "
                                        r"meets a residual add \(a block's end\) before any "
                                        r"other linear: blocks\.0\.weight's reaches "
                                        r"blocks\.1\.weight only past one; a weight "
                                        r"computed in forward"):
        plan_tp(captured(OneLinearBlocks(), x_batch()).gm.graph, 2)


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
           "transformers/models/llama/modeling_llama.py:" in "\n".join(d.report)
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
    assert any(line.startswith("layout replicated_heads (2 kv heads of head_dim 8, fewer than "
                               "tp: rank r holds a copy of kv head r // (tp / 2), so each is "
                               "held by tp / 2 ranks") for line in d.report)


def test_gqa_tp3_plan_error(llama):
    """3 divides neither the 2 kv heads nor is a multiple of them (nor divides 4 heads)."""
    _, cap = llama
    with pytest.raises(PlanError, match=r"mesh.tp \(3\) must divide .*valid choices: tp in \{1, 2, 4\}"):
        plan_tp(cap.gm.graph, 3)


@pytest.mark.parametrize("ffn", [64, 96])
def test_gqa_kv_heads_neither_divided_nor_replicable_plan_error(ffn):
    """6 heads, 2 kv heads, tp 3: 3 divides the heads but neither divides the kv heads nor
    is a multiple of them; the error names the module, both numbers and the valid tps. With
    an FFN tp divides (96) the attention is kept whole instead, the FFN sharded, and the
    warning says the same (test_tp_indivisible_whole.py)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=ffn, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    cap = captured(transformers.LlamaForCausalLM(cfg).eval(), ids_batch())
    if ffn == 96:
        d = plan_tp(cap.gm.graph, 3)
        assert d.row == {"model.layers.0.mlp.down_proj.weight"}
        msg = d.warnings[0]
        assert msg.startswith("mesh.tp=3 keeps 4 linears whole on every tp rank "
                              "(model.layers.0.self_attn.k_proj, ")
        assert msg.endswith("tp in {2, 6} shards them too; see report.md"), msg
    else:
        with pytest.raises(PlanError) as e:
            plan_tp(cap.gm.graph, 3)
        msg = str(e.value)
        assert msg.startswith("mesh.tp (3) must divide the number of kv heads (2) of "
                              "model.layers.0.self_attn ("), msg
        assert "valid choices: tp in {1, 2} (sharding every group)" in msg, msg
    assert "or be a multiple of it (each kv head is then held by tp / kv heads ranks)" in msg


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




def _conflict_plan(op):
    cap = captured(TwoMLPs(op), x_batch())
    return plan_tp(cap.gm.graph, 2)


def _gathered_and_equal(op):
    """TwoMLPs with ``op`` between the first pair: both pairs shard, the first with an
    all-gather before ``op`` (its report line names the op and line), and the ranks' outputs
    equal the unmodified model's."""
    torch.manual_seed(0)
    model = TwoMLPs(op).eval()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    assert d.column == {"first.fc1.weight", "second.fc1.weight"}
    assert d.row == {"first.fc2.weight", "second.fc2.weight"}
    assert not any(line.startswith("kept replicated:") for line in d.report)
    apply_tensor_parallel(cap.gm, d)
    x = x_batch(3, 7, seed=1)
    with torch.no_grad():
        ref = model(*x)
    for out in forward_ranks(cap.gm, d, 2, list(x)):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    return [line for line in d.report if line.startswith("redistribution: all-gather")]


def test_cumsum_over_the_sharded_dim_is_gathered_not_replicated():
    lines = _gathered_and_equal(lambda h: torch.cumsum(h, dim=-1))
    line = line_of(__file__, "h = self.first.fc2(self.op(self.first.fc1(x)))")
    assert len(lines) == 1 and f"aten.cumsum.default (cumsum) at test_tp.py:{line}" in lines[0]


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


def test_sort_over_the_sharded_dim_is_gathered_not_replicated():
    lines = _gathered_and_equal(lambda h: torch.sort(h, dim=-1).values)
    assert len(lines) == 1 and "aten.sort" in lines[0]


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
    for out in forward_ranks(cap.gm, d, 2, list(x)):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    assert any("max" in line for line in d.report if line.startswith("redistribution:"))


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
    """The linear outside the blocks is counted and named: main before printed "4 of 4 weight
    matrices in blocks sharded", torchaudio's WaveRNN so with its ten whole matrices outside
    its blocks unsaid (a break test)."""
    code, io = _compile_cli(tmp_path, capsys, "torch.relu")
    assert code == 0, io.err
    # sharded: 4 block matrices of 2048 and the two fc1 biases
    sharded = 4 * 2048 + 2 * 64
    total = sharded + 2 * 32 + 8 * 32 + 32 + 2 * 64  # + 2 LayerNorms
    lines = io.out.splitlines()
    assert f"tensor parallel: 4 of 4 weight matrices in blocks sharded; 0 of 1 outside them " \
           f"({100 * sharded / total:.0f} % of parameters)" in lines, io.out
    assert "tensor parallel: not sharded embed.weight; replicated linear: embed.weight (" in \
        io.out, io.out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- tensor parallel: 4 of 4 weight matrices in blocks sharded; 0 of 1 outside" in report


def test_compile_with_nothing_sharded_exits_2_naming_the_op(tmp_path, capsys, in_place_kept):
    code, io = _compile_cli(tmp_path, capsys, "(lambda h: h.cumsum_(-1))")
    assert code == 2
    assert io.err.startswith("error: mesh.tp=2 but no weight matrix could be sharded; the first "
                             "op that stopped it: aten.cumsum_.default at model.py:12 in "
                             "blocks.0: no sharding rule for aten.cumsum_.default (ours or "
                             "DTensor's); it writes into its sharded input in place"), io.err
    assert "tensor_parallel.allow_replicated=true" in io.err
    assert not (tmp_path / "out").exists()
    code, io = _compile_cli(tmp_path, capsys, "(lambda h: h.cumsum_(-1))",
                            "tensor_parallel.allow_replicated=true")
    assert code == 0, io.err
    assert "tensor parallel: 0 of 4 weight matrices in blocks sharded; 0 of 1 outside them " \
           "(0 % of parameters)" in io.out
    assert "warning: mesh.tp=2 but no weight matrix could be sharded" in io.err


def test_a_layout_conflict_names_the_read_in_parts_and_its_module(tmp_path, capsys):
    """A column output scaled in place through a slice of its features (a break test's
    custom Function did it): the refusal named the block's last line "in the root module";
    it names the slice and its block."""
    code, io = _compile_cli(tmp_path, capsys,
                            "(lambda h: (lambda y: (y[..., :4].mul_(0.5), y)[1])(h * 2.0))")
    assert code == 2
    assert io.err.startswith("error: mesh.tp=2 but no weight matrix could be sharded; the first "
                             "op that stopped it: aten.slice.Tensor at model.py:12 in blocks.0: "
                             "blocks.0.fc1.weight's output is used both as an evenly split "
                             "tensor and as a fused tensor"), io.err


def test_a_norm_within_a_block_is_gathered_and_one_before_a_head_ends_the_walk(tmp_path, capsys):
    """fc1 -> LayerNorm over its features -> fc2 -> the residual: the refusal said "no linear
    layer feeds another" (a held-out zoo's NormFormer FFN), then named the norm that ends the
    walk (a norm right on fc1's output is written out and sharded since, decision 103: a
    shift between keeps it one op). Within a block the pair now goes on through it, the norm
    computed whole after an all-gather (decision 174); where the linear after it ends no
    block (a head) the walk still ends there, and the refusal names the norm."""
    between = "(lambda h: torch.nn.functional.layer_norm(h + 1.0, (64,)))"
    code, io = _compile_cli(tmp_path, capsys, between)
    assert code == 0, io.err
    assert "tensor parallel: 4 of 4 weight matrices in blocks sharded" in io.out and \
        "2 sharded activation(s) all-gathered" in io.out, io.out
    from parallelizer.cli import parallelize as cli
    (tmp_path / "model.py").write_text(_HEAD_MODEL)
    code = cli.main([str(tmp_path / "model.py"), str(tmp_path / "spec.yaml"), "-o",
                     str(tmp_path / "out2"), "--no-weights"])
    io = capsys.readouterr()
    assert code == 2, io.out + io.err
    assert io.err.startswith("error: mesh.tp=2 but no weight matrix could be sharded; no "
                             "column/row pair was found: dense.weight's output meets "
                             "aten.layer_norm.default at model.py:12 (a LayerNorm over all its "
                             "features, which ends a pair as a block's input norm does) before "
                             "any other linear"), io.err


_HEAD_MODEL = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.head = nn.Linear(32, 64), nn.Linear(64, 40)

    def forward(self, x):
        return self.head(nn.functional.layer_norm(self.dense(x).relu() + 1.0, (64,))).mean()


def build_model():
    return Model()


def example_inputs():
    return (torch.randn(2, 4, 32),)
'''
