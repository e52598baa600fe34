"""Tensor parallelism inside the experts (analysis/expert_ffn.py, planning/experts.py,
passes/expert_parallel.py; docs/expert-parallel.md): the stacked gate | up weight column
parallel along the FFN dim (fused: each rank its block of gate and of up), down row
parallel, an f on the rows entering the experts and one g after them.

- Three real transformers MoE families (Mixtral, Qwen2-MoE with a shared expert, DeepSeek-V3
  with group-limited routing) at tp2 pass the numerics self-check: every tp rank of the
  emitted program in threads of one process against the unmodified model, outputs and every
  gradient (emit/numerics_check.py).
- Explicit sizes in the region (gate | up cut by slices of F) are rewritten to the local size;
  gate and up interleaved (strided slices) split in contiguous blocks; a bias added to the
  gate | up output (GPT-OSS's, per expert) split with it; what tp cannot split (a tensor made
  in forward across the features) keeps that layer's experts whole on every tp rank,
  report.md naming the op and the line, and the program is still right.
- A program missing the experts' f or g is a compile error.
- ep x tp: the ranks' (E/ep, 2F/tp, H) pieces and f -> dispatch -> experts -> g -> combine.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from parallelizer import compiler
from parallelizer.errors import PlanError
from parallelizer.frontend.spec import Spec
from parallelizer.runtime.tp import copy_to_tp_region, reduce_from_tp_region

MODELS = Path(__file__).resolve().parents[1] / "distributed" / "user_models"
TP2 = {"mesh": {"tp": 2}}
NOTE = r"self-check: 2 tp rank\(s\) of the program against the model"


def _user(name: str):
    sys.path.insert(0, str(MODELS))
    try:
        m = __import__(name)
    finally:
        sys.path.remove(str(MODELS))
    return m.build_model(), m.example_inputs()


def _compile(model, batch, spec=TP2, **kw):
    return compiler.compile_module(model, batch, Spec.model_validate(spec), reference=False, **kw)


def _experts(model):
    return [m.mlp.experts for m in model.model.layers if hasattr(m.mlp, "experts")]


@pytest.mark.parametrize("name, layer, ffn", [("mixtral_auto", 0, 64), ("qwen2_moe_ep", 0, 16),
                                              ("deepseek_v3_grouped", 1, 32)])
def test_real_moe_models_split_experts_over_tp_and_pass_the_self_check(name, layer, ffn):
    program = _compile(*_user(name))
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert note.startswith("self-check: 2 tp rank(s) of the program against the model"), note
    gate_up = program.plan.tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    down = program.plan.tensors[f"model.layers.{layer}.mlp.experts.down_proj"]
    assert (gate_up.tp_dim, gate_up.layout.parts, gate_up.role) == (1, (ffn, ffn), "experts")
    assert gate_up.rank_shape(2) == (4, ffn, 32) and down.rank_shape(2) == (4, 32, ffn // 2)
    assert down.tp_dim == 2 and down.layout is None
    src = program.sources["program/stage0.py"]
    f = src.index("tp.copy_to_tp_region(to_dtype", src.index("mlp_experts_gate_up_proj ="))
    assert f < src.index("grouped_mm_fallback.default(copy_to_tp_region") < src.index(
        "tp.reduce_from_tp_region(grouped_mm_fallback_default_1)")
    assert "kept replicated: model.layers" not in program.report  # the tp planner's old line
    assert f"experts of model.layers.{layer}.mlp.experts split over tp=2" in program.report


def _slices(self, h):  # gate | up cut by explicit sizes: F is rewritten to F / tp
    f = self.gate_up_proj.shape[1] // 2
    return self.act_fn(h[:, :f]) * h[:, f:]


def _strided(self, h):  # gate and up interleaved: each rank's contiguous block holds pairs
    return self.act_fn(h[..., ::2]) * h[..., 1::2]


def _ramp(self, h):  # a tensor made in forward across the features: tp cannot split it
    f = h.shape[-1] // 2
    return self.act_fn(h[:, :f]) * h[:, f:] * torch.linspace(0.5, 1.5, f)


def test_explicit_slices_in_the_experts_are_rewritten_to_the_local_size():
    model, batch = _user("mixtral_auto")
    for e in _experts(model):
        e._apply_gate = types.MethodType(_slices, e)
    program = _compile(model, batch)
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")]
    src = program.sources["program/stage0.py"]
    assert "slice.Tensor(slice_tensor_4, 1, 0, 32)" in src  # h[:, :64] -> h[:, :32]
    assert "slice.Tensor(slice_tensor_6, 1, 32, 9223372036854775807)" in src  # h[:, 64:]
    assert program.plan.tensors["model.layers.0.mlp.experts.gate_up_proj"].layout.parts == (64, 64)


def test_interleaved_gate_and_up_split_in_contiguous_blocks():
    """``h[..., ::2]`` / ``h[..., 1::2]`` on each rank's contiguous block of 2F / tp (even)
    take that block's gates and ups: the experts split (they were kept whole)."""
    model, batch = _user("mixtral_auto")
    for e in _experts(model):
        e._apply_gate = types.MethodType(_strided, e)
    program = _compile(model, batch)
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")]
    gate_up = program.plan.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.tp_dim == 1 and gate_up.layout is None  # plain blocks, no fused parts


def test_what_tp_cannot_split_keeps_the_experts_whole_naming_the_line():
    model, batch = _user("mixtral_auto")
    for e in _experts(model):
        e._apply_gate = types.MethodType(_ramp, e)
    program = _compile(model, batch)
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")]  # still right
    # the op and the line export recorded for it (the experts' forward in transformers)
    assert re.search(r"experts of model.layers.0.mlp.experts kept whole on every tp rank: "
                     r"aten.mul.Tensor \(mul_\d+\) at [\w/]+.py:\d+: reads linspace \[64\] across "
                     r"the FFN features", program.report), program.report
    assert program.plan.tensors["model.layers.0.mlp.experts.gate_up_proj"].tp_dim is None


def test_gpt_oss_experts_split_with_their_biases():
    """GPT-OSS (transformers): a per-expert bias (E, 2F) gathered by expert and added to the
    gate | up output is split with it along dim 1, gate and up interleaved; the down bias,
    added after the all-reduce, stays whole. Was: experts kept whole ("reads index_2 across
    the FFN features"), 17 % of parameters sharded."""
    program = _compile(*_user("gpt_oss_ep"))
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")], program.notes
    t = program.plan.tensors
    pre = "model.layers.0.mlp.experts."
    assert (t[pre + "gate_up_proj"].tp_dim, t[pre + "gate_up_proj_bias"].tp_dim) == (2, 1)
    assert t[pre + "down_proj"].tp_dim == 1 and t[pre + "down_proj_bias"].tp_dim is None
    assert f"replicated: {pre}gate_up_proj_bias" not in program.report
    assert f"{pre}gate_up_proj_bias with {pre}gate_up_proj (dim 1)" in program.report


@pytest.fixture(params=[copy_to_tp_region, reduce_from_tp_region], ids=["f", "g"])
def drops_an_expert_operator(request, monkeypatch):
    """The expert_parallel pass, then the first experts' f (or g) removed."""
    real, op = compiler.apply_expert_parallel, request.param

    def broken(gm, decision):
        changed = real(gm, decision)
        node = next(n for n in gm.graph.nodes if n.target is op)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        gm.recompile()
        return changed

    monkeypatch.setattr(compiler, "apply_expert_parallel", broken)
    return request.param


def test_experts_missing_their_f_or_g_fail_the_compile(drops_an_expert_operator):
    with pytest.raises(PlanError, match=r"internal error \(a bug in parallelizer"):
        _compile(*_user("mixtral_auto"))


def test_ep_with_tp_holds_both_splits_and_dispatches_inside_f_and_g():
    model = _user("mixtral_auto")[0].to("meta")
    _, batch = _user("mixtral_auto")
    program = _compile(model, batch, {"mesh": {"tp": 2, "dp": 2, "ep": 2}})
    t = program.plan.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert t.experts.ep == 2 and t.tp_dim == 1 and t.rank_shape(2) == (2, 64, 32)
    assert program.plan.tensors["model.layers.0.mlp.experts.down_proj"].rank_shape(2) == (2, 32, 32)
    src = program.sources["program/stage0.py"]
    order = [src.index(s) for s in ("tp.copy_to_tp_region(to_dtype", "expert_parallel.ep_dispatch(",
                                    "grouped_mm_fallback.default(ep_dispatch",
                                    "tp.reduce_from_tp_region(grouped_mm_fallback_default_1)",
                                    "expert_parallel.ep_combine(reduce_from_tp_region")]
    assert order == sorted(order), order
    assert ("| model.layers.0.mlp.experts.gate_up_proj | [4, 128, 32] | Shard(1), fused; experts "
            "(dim 0 over ep=2) | experts |") in program.report


def test_compiled_checkpoint_with_both_splits_reshards_and_exports_bit_exact(tmp_path):
    """The compiled (stage, tp) files hold every expert's tp piece (fused gate | up blocks);
    ``reshard --tp 1 --ep 1`` and ``export`` give the model's own weights back, bit for bit."""
    from safetensors.torch import load_file, save_file
    from parallelizer.convert.export import export_hf
    from parallelizer.convert.reshard import reshard
    model, batch = _user("mixtral_auto")
    original = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    program = _compile(model, batch, {"mesh": {"tp": 2, "dp": 2, "ep": 2}})
    program.save(tmp_path / "out")
    piece = load_file(str(tmp_path / "out" / "checkpoint" / "pp0-tp1.safetensors"))
    gate_up = original["model.layers.0.mlp.experts.gate_up_proj"]  # (4, 128, 32): gate | up
    assert torch.equal(piece["model.layers.0.mlp.experts.gate_up_proj"],
                       torch.cat([gate_up[:, 32:64], gate_up[:, 96:128]], 1))  # rank 1's blocks
    reshard(tmp_path / "out" / "checkpoint", tmp_path / "one", tp=1, pp=1, ep=1)
    export_hf(tmp_path / "one", tmp_path / "hf")
    save_file(original, str(tmp_path / "original.safetensors"))
    want = load_file(str(tmp_path / "original.safetensors"))
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_estimate_counts_one_ep_x_tp_block_of_the_experts_per_rank():
    """``parallelize estimate``: an expert weight, its gradient and AdamW's two states are
    1/(ep x tp) of the layer's experts on every rank (by hand, the MEMORY lines of
    ``run.py --train --steps 1 --profile`` at dp2 x ep2 x tp2 ZeRO-3 equal these: 60,224
    parameter bytes per rank; docs/expert-parallel.md)."""
    from parallelizer.advisor.memory import estimate_model_file
    from parallelizer.frontend.spec import load_spec

    def ranks(*overrides):
        spec = load_spec(MODELS / "spec.yaml", ["optimizer.name=adamw", "mesh.dp=2", *overrides])
        return estimate_model_file(MODELS / "mixtral_train.py", spec)[1]

    experts = 2 * (4 * 128 * 32 + 4 * 32 * 64) * 4  # bytes of all experts of the 2 layers
    tp2, both = ranks("mesh.tp=2", "zero_stage=0"), ranks("mesh.tp=2", "mesh.ep=2", "zero_stage=0")
    assert len(both) == 4
    for a, b in zip(tp2, both):  # tp alone holds experts / 2, ep x tp experts / 4
        assert a.parameters - b.parameters == experts // 4 == a.gradients - b.gradients
        assert a.optimizer - b.optimizer == 2 * experts // 4
    z3 = ranks("mesh.tp=2", "mesh.ep=2", "zero_stage=3")
    assert [(r.parameters, r.gradients, r.optimizer, r.buffers) for r in z3] == [
        (60224, 60224, 120532, 16)] * 4


def test_heads_tp_does_not_divide_keep_attention_whole_and_the_experts_split():
    """Mixtral with 3 kv heads at tp2: attention is kept whole (tp_candidates._whole_indivisible)
    and the experts split over tp. It was refused ("mesh.tp (2) must divide the number of kv
    heads (3)"): the kept-whole plan shards no linear, and only such a plan counted."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=48, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3,
                               num_local_experts=4, num_experts_per_tok=2, use_cache=False,
                               router_jitter_noise=0.0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    program = _compile(model, {"input_ids": ids})
    assert any(re.match(NOTE, n) for n in program.notes), program.notes
    assert program.plan.tensors["model.layers.0.mlp.experts.down_proj"].tp_dim == 2
    assert program.plan.tensors["model.layers.0.self_attn.q_proj.weight"].tp_dim is None
    assert program.warnings == [
        "mesh.tp=2 keeps 4 linears whole on every tp rank (model.layers.0.self_attn.k_proj, "
        "model.layers.0.self_attn.o_proj, model.layers.0.self_attn.q_proj and 1 more), only the "
        "experts split: tp must divide the number of kv heads (3) of model.layers.0.self_attn "
        "(dim 2 of the view to [*, *, 3, 8]), or be a multiple of it (each kv head is then held "
        "by tp / kv heads ranks); tp in {3, 6} shards them too; see report.md"]


def test_experts_reading_a_gathered_shard_get_their_f_after_the_gather():
    """transformers' Muse-Spark: a column-parallel ``pre_expert_proj``, a norm over its
    whole (sharded) output, then experts split over tp. The norm's output is all-gathered
    for the experts (a redistribution) and the experts' f is put on the same edge by the
    expert pass first: the gather was left unread and the experts read the shard, refused
    as an internal error by the gradient accounting (a held-out zoo). The gather now feeds
    the f: f(all_gather(x)), the split experts' Partial gradient summed before the gather's
    backward takes the rank's slice."""
    import transformers as T
    torch.manual_seed(0)
    config = T.MuseSparkTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        layer_types=["full_attention"], mlp_layer_types=["sparse"], moe_intermediate_size=16,
        moe_hidden_size=16, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
        use_cache=False, attn_implementation="sdpa")
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    program = _compile(T.MuseSparkTextModel(config).train(), {"input_ids": ids})
    assert any(re.match(NOTE, n) for n in program.notes), program.notes
    src = program.sources["program/stage0.py"]
    f_after_gather = r"copy_to_tp_region_?\d* = tp\.copy_to_tp_region\(gather_from_tp_dim\)"
    assert re.search(f_after_gather, src), src
