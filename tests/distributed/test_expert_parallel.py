"""Expert parallelism end to end (docs/expert-parallel.md): real transformers MoE classes
compiled at mesh.dp=2, mesh.ep=2 (ZeRO-3, the default zero_stage, for the other parameters)
and run on two gloo ranks.

- ``--verify``: loss, outputs, gradients gathered to full shape and parameters after one SGD
  step equal the unmodified model's at fp32 1e-5: Mixtral (softmax top-k, renormalised) under
  the real torchrun, Qwen2-MoE (top-k without renormalisation, a shared expert beside the
  routed ones) in ranks forked from the warm server.
- Each rank holds half the experts (the emitted parameter is (E/2, ...)).
- A per-rank save writes each ep rank's expert rows (its chunk of dim 0); ``reshard --ep 1``
  merges them, and ``export`` gives back the model's own weights bit for bit (real
  safetensors files on both sides).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallelizer.compiler import compile_model
from parallelizer.convert.export import export_hf
from parallelizer.convert.reshard import reshard
from parallelizer.errors import CheckpointError
from parallelizer.frontend.spec import load_spec

MODELS = Path(__file__).parent / "user_models"
EP2 = ["mesh.dp=2", "mesh.ep=2"]
EXPERT = "model.layers.0.mlp.experts.gate_up_proj"


def _compile(name: str, out: Path):
    program = compile_model(MODELS / f"{name}.py", load_spec(MODELS / "spec.yaml", EP2))
    program.save(out)
    return program


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, real", [("mixtral_auto", True), ("qwen2_moe_ep", False)])
def test_verify_at_ep2(tmp_path, tools, name, real):
    program = _compile(name, tmp_path / "out")
    t = program.plan.tensors[EXPERT]
    assert t.experts.ep == 2 and t.rank_shape(1)[0] == t.shape[0] // 2
    run = tools.real_torchrun if real else tools.torchrun
    res = run(tmp_path / "out", 2, "--verify", timeout=240)
    errs = tools.verify_errors(res.stdout)
    assert "PASS" in res.stdout and len(errs) == 4 and max(errs.values()) <= 1e-5, res.explain()
    assert "verify: mesh pp=1 x dp=2 (ep=2) x tp=1" in res.stdout, res.explain()
    tools.check_exit(res)


@pytest.mark.timeout(300)
def test_save_at_ep2_reshard_to_ep1_and_export_bit_exact(tmp_path, tools):
    _compile("mixtral_auto", tmp_path / "out")
    res = tools.torchrun(tmp_path / "out", 2, "--train", "--steps", "0", "--save",
                         str(tmp_path / "ck"), timeout=240)
    tools.check_exit(res)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    entry = manifest["tensors"][EXPERT]
    assert entry["experts"] == {"kind": "experts", "ep": 2, "dim": 0}
    assert [(c["file"], c["rows"]) for c in entry["pieces"][0]["chunks"]] == [
        ("pp0-tp0-dp0.safetensors", [0, 2]), ("pp0-tp0-dp1.safetensors", [2, 4])]
    for d in (0, 1):  # each rank wrote its own two experts only
        assert load_file(str(tmp_path / "ck" / f"pp0-tp0-dp{d}.safetensors"))[EXPERT].shape[0] == 2
    with pytest.raises(CheckpointError, match=r"--ep 3 does not divide the 4 experts of "
                                              r"model.layers.\d.mlp.experts.\w+; ep values that fit: 1, 2, 4"):
        reshard(tmp_path / "ck", tmp_path / "ep3", tp=1, pp=1, ep=3)
    reshard(tmp_path / "ck", tmp_path / "ep1", tp=1, pp=1, ep=1)
    merged = json.loads((tmp_path / "ep1" / "manifest.json").read_text())["tensors"][EXPERT]
    assert "experts" not in merged and merged["role"] == "experts"
    export_hf(tmp_path / "ep1", tmp_path / "hf")
    sys.path.insert(0, str(MODELS))
    try:
        import mixtral_auto
    finally:
        sys.path.remove(str(MODELS))
    save_file({k: v.contiguous() for k, v in mixtral_auto.build_model().state_dict().items()},
              str(tmp_path / "original.safetensors"))
    original = load_file(str(tmp_path / "original.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    different = [k for k in original if not torch.equal(exported[k], original[k])]
    assert different == []
