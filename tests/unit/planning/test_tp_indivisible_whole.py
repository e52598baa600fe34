"""A size tp does not divide keeps only the pair groups behind it whole
(tp_candidates.py _whole_indivisible): an FFN of 42 features at tp 4, or transformers'
Llama with intermediate_size 37 (the size its own test configs use) at tp 2, was refused
("mesh.tp (2) must divide the number of features (37) ...; valid choices: tp in {1}")
although its attention shards. Now that FFN is computed whole on every tp rank, reported
and warned about, and the rest is sharded; each rank equals the unmodified model (outputs,
every gradient, one SGD step; fp32, 1e-5). Where nothing is left to shard the refusal
naming the size and the valid degrees stands."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.planning.tp import plan_tp

from tp_check import assert_tp_matches, planned
from tp_small_models import H, Block, captured, ids_batch, tiny_lm, x_batch


# one layer, 4 heads over 2 kv heads, an FFN of 37 (Phi-3 and OLMo-2 at tp4)
FFN37_KV2 = dict(vocab_size=64, hidden_size=H, intermediate_size=37, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                 pad_token_id=0, tie_word_embeddings=False)


def _block(ffn: int) -> nn.Module:
    torch.manual_seed(0)
    model = Block()
    model.mlp.gate = nn.Linear(H, ffn, bias=False)
    model.mlp.up = nn.Linear(H, ffn, bias=False)
    model.mlp.down = nn.Linear(ffn, H, bias=False)
    return model


def test_ffn_tp_does_not_divide_is_kept_whole_and_attention_sharded():
    model = _block(42)
    gm, d = planned(model, x_batch(), 4)
    assert d.column == {"attn.q.weight", "attn.k.weight", "attn.v.weight"}
    assert d.row == {"attn.o.weight"}
    why = ("tp = 4 does not divide the 42 features of mlp.gate (out_features of "
           "mlp.gate.weight)")
    for w in ("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"):
        assert f"kept whole: {w} ({why})" in d.report
    assert not any(line.startswith("replicated linear: mlp.") for line in d.report), d.report
    assert d.warnings == [
        "mesh.tp=4 keeps 3 linears whole on every tp rank (mlp.down, mlp.gate, mlp.up), the "
        "rest sharded: tp must divide the number of features (42) of mlp.gate (out_features "
        "of mlp.gate.weight); tp in {2} shards them too; see report.md"]
    assert_tp_matches(model, x_batch(), 4, d, gm)


def test_tp_dividing_every_size_shards_the_ffn_too():
    model = _block(42)
    gm, d = planned(model, x_batch(), 2)
    assert {"mlp.gate.weight", "mlp.up.weight"} <= d.column and "mlp.down.weight" in d.row
    assert d.warnings == []
    assert_tp_matches(model, x_batch(), 2, d, gm)


def test_heads_tp_does_not_divide_keep_attention_whole_and_the_ffn_sharded():
    model = _block(42)
    gm, d = planned(model, x_batch(), 3)
    assert d.column == {"mlp.gate.weight", "mlp.up.weight"} and d.row == {"mlp.down.weight"}
    assert "kept whole: attn.o.weight (tp = 3 does not divide the 4 heads of attn (dim 2 of " \
           "the view to [*, *, 4, 8]))" in d.report
    assert d.warnings[0].endswith("tp in {2} shards them too; see report.md"), d.warnings
    assert_tp_matches(model, x_batch(), 3, d, gm)


def test_nothing_left_to_shard_is_still_the_error_naming_the_size():
    cap = captured(_block(64), x_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 3)
    msg = str(e.value)
    assert msg.startswith("mesh.tp (3) must divide the number of heads (4) of attn ")
    assert "valid choices: tp in {1, 2, 4} (sharding every group)" in msg, msg


def test_the_refusal_names_the_degrees_that_shard_some_groups():
    """4 heads and an FFN of 42 at tp 5: nothing divides, refused; the valid choices listed
    only {1, 2} though tp 3, 6, 7, ... compile, keeping one group whole (a break test)."""
    cap = captured(_block(42), x_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 5)
    some = (3, 4, 6, 7, 8, 14, 16, 21, 32, 42)
    assert str(e.value).endswith(f"valid choices: tp in {{1, 2}} (sharding every group); tp in "
                                 f"{{{', '.join(map(str, some))}}} divides some of the sizes: it "
                                 f"shards those groups and keeps the others whole; or "
                                 f"tensor_parallel.allow_replicated=true runs it "
                                 f"replicated"), str(e.value)
    for tp in some:  # as it says: each compiles
        plan_tp(cap.gm.graph, tp)


class FusedParallelBlock(nn.Module):
    """q | k | v | up | gate in one projection, 3 kv heads (a break test's PaLM-style GQA)."""

    def __init__(self):
        super().__init__()
        self.fused = nn.Linear(H, 6 * 8 + 2 * 3 * 8 + 2 * 48, bias=False)
        self.o, self.down = nn.Linear(6 * 8, H, bias=False), nn.Linear(48, H, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v, up, gate = self.fused(x).split([48, 24, 24, 48, 48], -1)
        q = q.view(b, t, 6, 8).transpose(1, 2)
        k, v = (y.view(b, t, 3, 8).transpose(1, 2).repeat_interleave(2, dim=1) for y in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return x + self.o(a.reshape(b, t, 48)) + self.down(F.silu(gate) * up)


def test_a_degree_that_shards_nothing_is_not_offered():
    """Keeping the 3 kv heads' group whole keeps the fused projection whole, the MLP's half
    too: the refusal at tp 2 offered "tp in {2, 4, ...}: it shards those groups and keeps
    the others whole", tp 2 itself included. It says why not and what to set instead."""
    cap = captured(FusedParallelBlock(), x_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 2)
    msg = str(e.value)
    assert "tp in {1, 3} (sharding every group)" in msg and "keeps the others whole" not in msg
    # the size it divides is named (a zoo's refusal guessed "a fused projection" of a model
    # with none: zoo 23 F3)
    assert msg.endswith("tp = 2 divides some of the sizes (the 6 heads of the model (the heads "
                        "of a part of the fused output of fused.weight (sliced into [48, 24, 24, "
                        "48, 48]))), but keeping the groups behind the others whole leaves no "
                        "plan that shards a weight (each divisible group needs one of them: a "
                        "projection fused with them, a row whose column they keep whole); or "
                        "set tensor_parallel.allow_replicated=true to run replicated"), msg


def test_transformers_llama_with_an_odd_intermediate_size_shards_its_attention():
    model = tiny_lm(
        "Llama",
        vocab_size=64, hidden_size=H, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="sdpa")
    batch = (ids_batch()["input_ids"],)
    gm, d = planned(model, batch, 2)
    layers = ("lm.model.layers.0", "lm.model.layers.1")
    assert d.column == {f"{l}.self_attn.{p}_proj.weight" for l in layers for p in "qkv"}
    assert d.row == {f"{l}.self_attn.o_proj.weight" for l in layers}
    assert {f"{l}.mlp.{p}_proj.weight" for l in layers for p in ("gate", "up", "down")} \
        == {w for w, lines in d.replicated.items() if lines[0].startswith("kept whole: ")}
    assert d.warnings[0].startswith("mesh.tp=2 keeps 6 linears whole on every tp rank")
    assert d.warnings[0].endswith("(out_features of lm.model.layers.0.mlp.gate_proj.weight); "
                                  "no tp > 1 divides every size; see report.md")
    assert_tp_matches(model, batch, 2, d, gm)


def test_the_kept_whole_plan_keeps_the_redistributions_the_rest_needs():
    """BitNet's attention shards only with its sub-norm's mean over the sharded attention
    output all-reduced; the plan without redistributions (chosen before when a size did not
    divide) kept it replicated too, and with its FFN of 37 whole nothing was left: refused
    'no weight matrix could be sharded' at tp2."""
    model = tiny_lm(
        "BitNet",
        vocab_size=64, hidden_size=H, intermediate_size=37, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=False)
    batch = (ids_batch()["input_ids"],)
    gm, d = planned(model, batch, 2)
    attn = "lm.model.layers.0.self_attn"
    assert d.column == {f"{attn}.{p}_proj.weight" for p in "qkv"}
    assert d.row == {f"{attn}.o_proj.weight"}
    assert [r.kind for r in d.redistributions] == ["all_reduce"]
    assert_tp_matches(model, batch, 2, d, gm)


def test_copied_kv_heads_and_an_indivisible_ffn_compose():
    """Phi-3 at tp4 with 2 kv heads and a fused gate|up of 37 features: the q|k|v sliced
    from one projection is sharded with its kv parts copied (test_tp_whole_kv.py), the FFN
    kept whole. Before, the kv plan gave up on the other size and the compile was refused
    ('must divide the number of heads (2)')."""
    model = tiny_lm("Phi3", **FFN37_KV2)
    batch = (ids_batch()["input_ids"],)
    gm, d = planned(model, batch, 4)
    layer = "lm.model.layers.0"
    assert d.column == {f"{layer}.self_attn.qkv_proj.weight"}
    assert d.row == {f"{layer}.self_attn.o_proj.weight"}
    kept = {w for w, lines in d.replicated.items() if lines[0].startswith("kept whole: ")}
    assert kept == {f"{layer}.mlp.gate_up_proj.weight", f"{layer}.mlp.down_proj.weight"}
    assert_tp_matches(model, batch, 4, d, gm)


def test_a_kv_projection_kept_whole_and_an_indivisible_ffn_compose():
    """OLMo-2 at tp4: its k is RMS-normed over all 2 kv heads before the heads view, so
    k_proj is kept whole (tp_candidates._whole_kv, decision 68), and its FFN of 37 too; q,
    v and o stay sharded. Before, the kv plan gave up on the other size and the plain plan
    kept attention replicated as well."""
    model = tiny_lm("Olmo2", **FFN37_KV2)
    batch = (ids_batch()["input_ids"],)
    gm, d = planned(model, batch, 4)
    attn, mlp = "lm.model.layers.0.self_attn", "lm.model.layers.0.mlp"
    assert d.column == {f"{attn}.q_proj.weight", f"{attn}.v_proj.weight"}
    assert d.row == {f"{attn}.o_proj.weight"}
    assert any(line.startswith(f"kept whole: {attn}.k_proj.weight") for line in d.report)
    kept = {w for w, lines in d.replicated.items() if lines[0].startswith("kept whole: ")}
    assert kept == {f"{mlp}.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert_tp_matches(model, batch, 4, d, gm)


class InlineSlicedBlock(nn.Module):
    """Attention and MLP written inline in one module (no submodules to tell them apart),
    q|k|v sliced from one projection: 3 heads of 10, an MLP of 64."""

    def __init__(self, e=30, heads=3, ffn=64):
        super().__init__()
        self.e, self.heads = e, heads
        self.qkv = nn.Linear(e, 3 * e, bias=False)
        self.o = nn.Linear(e, e, bias=False)
        self.up, self.down = nn.Linear(e, ffn), nn.Linear(ffn, e)

    def forward(self, x):
        b, t, e = x.shape
        d = e // self.heads
        h = self.qkv(x)
        q, k, v = (h[..., i * e:(i + 1) * e].view(b, t, self.heads, d).transpose(1, 2)
                   for i in range(3))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, e))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("tp", [2, 4])
def test_sliced_parts_tp_does_not_divide_keep_attention_whole_in_an_inline_block(tp):
    """Two bugs a new user found: at tp 4 the slices' local offsets of a fused part of 30
    raised a raw ValueError ('tp degree 4 does not divide a fused part (30)') out of the
    planner; at tp 2 the heads constraint of the block's module took the MLP whole with the
    attention (the module holds both), so nothing was left and the compile was refused. The
    kept groups are now the weights the constraint names."""
    torch.manual_seed(0)
    model = InlineSlicedBlock()
    batch = (torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(0)),)
    gm, d = planned(model, batch, tp)
    assert d.column == {"up.weight"} and d.row == {"down.weight"}
    assert "kept whole: qkv.weight (tp = %d does not divide the 3 heads of the model" % tp \
        in "\n".join(d.report)
    assert_tp_matches(model, batch, tp, d, gm)


class OnlyMLP37(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 37), nn.Linear(37, H)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_allow_replicated_runs_a_model_whose_only_pair_tp_does_not_divide():
    """tensor_parallel.allow_replicated ('run even when no weight matrix could be sharded')
    was ignored for a size tp does not divide: the refusal came first. Now the plan shards
    nothing and the compile warns, naming the size; without the key it is still refused."""
    cap = captured(OnlyMLP37(), x_batch())
    with pytest.raises(PlanError, match=r"mesh.tp \(2\) must divide the number of features "
                                        r"\(37\) of fc1"):
        plan_tp(cap.gm.graph, 2)
    d = plan_tp(cap.gm.graph, 2, allow_replicated=True)
    assert d.column == d.row == set() and d.rewrites == {}
    assert d.warnings == [
        "mesh.tp=2 but no weight matrix could be sharded (the first op that stopped it: tp "
        "must divide the number of features (37) of fc1 (out_features of fc1.weight)): every "
        "rank holds the whole model (tensor_parallel.allow_replicated); see report.md"]


class PackedQKV6(nn.Module):
    """timm's ViT attention with 6 heads: q | k | v in one projection viewed ``(B, T, 3, 6,
    8)``, each part taken by the unbind of a permute; an MLP after it."""

    def __init__(self, ffn=64):
        super().__init__()
        self.qkv, self.o = nn.Linear(H, 3 * 48), nn.Linear(48, H)
        self.up, self.down = nn.Linear(H, ffn), nn.Linear(ffn, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 6, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.o(a.reshape(b, t, 48))
        return x + self.down(F.gelu(self.up(x)))


def test_packed_parts_tp_does_not_divide_name_a_parts_heads():
    """At tp 4 the reason named the 3 parts as the heads ("does not divide the 3 heads (dim 2
    of the view to [*, *, 3, 6, 8])", a held-out zoo): the parts are q, k and v, each of 6
    heads, and the degrees offered followed the 3. The 6 heads are named now, and the tp the
    warning offers shards them."""
    torch.manual_seed(0)
    model = PackedQKV6()
    gm, d = planned(model, x_batch(), 4)
    assert d.column == {"up.weight"} and d.row == {"down.weight"}
    assert "kept whole: qkv.weight (tp = 4 does not divide the 6 heads of the model (a part " \
           "of dim 2 of the view to [*, *, 3, 6, 8]))" in d.report, d.report
    assert d.warnings[0].endswith("tp in {2} shards them too; see report.md"), d.warnings
    assert_tp_matches(model, x_batch(), 4, d, gm)
    _gm2, d2 = planned(PackedQKV6(), x_batch(), 2)
    assert {"qkv.weight", "up.weight"} <= d2.column and d2.warnings == []


def test_refusal_names_every_size_tp_does_not_divide():
    """4 heads and an FFN of 37 at tp 3: the refusal named the heads only, so a user who
    changed them met the FFN on the next compile (zoo 10 F5). Each distinct size is named,
    once, wherever it recurs."""
    cap = captured(_block(37), x_batch())
    with pytest.raises(PlanError) as e:
        plan_tp(cap.gm.graph, 3)
    msg = str(e.value)
    assert msg.startswith("mesh.tp (3) must divide the number of heads (4) of attn "), msg
    assert ", and the number of features (37) of mlp.gate (out_features of mlp.gate.weight)" \
        in msg and msg.count("(37)") == 1 and "valid choices: tp in {1}" in msg, msg
