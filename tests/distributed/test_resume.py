"""Training state across layouts: 2 steps at (tp=2, pp=2), reshard to (tp=1, pp=2), resume 2
steps == 4 uninterrupted steps (losses, parameters and AdamW state). The uninterrupted run is
at dp=2 under FSDP2 (zero_stage 3: its DTensor optimizer state is gathered on save), and the
checkpoint is also resumed at dp=2 (FSDP2 loads the state); all losses of all runs agree."""
from __future__ import annotations

import re

import pytest
import torch

from parallelizer.checkpoint import load_full, read_manifest
from parallelizer.cli.convert import load_plan
from parallelizer.convert.reshard import reshard

TP2PP2 = ("mesh.dp=1", "mesh.tp=2", "mesh.pp=2")
PP2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2")
DP2 = ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1")  # the spec's zero_stage 3: FSDP2, DTensor states
_STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)


def losses(stdout: str) -> dict[int, float]:
    return {int(n): float(x) for n, x in _STEP.findall(stdout)}


@pytest.mark.precompile("gpt", *TP2PP2)
@pytest.mark.precompile("gpt", *PP2)
@pytest.mark.precompile("gpt", *DP2)
def test_resume_on_another_layout_equals_uninterrupted(compiled, tools, tmp_path):
    a, b, c = compiled("gpt", *TP2PP2), compiled("gpt", *PP2), compiled("gpt", *DP2)
    full = tools.torchrun(c, 2, "--train", "--steps", "4", "--save", str(tmp_path / "u4"))
    tools.check_exit(full)
    half = tools.torchrun(a, 4, "--train", "--steps", "2", "--save", str(tmp_path / "s2"))
    tools.check_exit(half)
    m = read_manifest(tmp_path / "s2")
    train = m["train"]
    assert (train["step"], train["optimizer"], train["data_position"]) == (2, "adamw", 2)
    assert train["world_size"] == 4 and len(train["rng"]) == 4
    # written by every rank: one file per (stage, tp, dp) coordinate, no gather
    assert sorted(m["files"]) == [f"pp{p}-tp{t}-dp0.safetensors" for p in (0, 1) for t in (0, 1)]
    assert sorted(read_manifest(tmp_path / "u4")["files"]) == ["pp0-tp0-dp0.safetensors",
                                                               "pp0-tp0-dp1.safetensors"]

    reshard(tmp_path / "s2", tmp_path / "r2", tp=1, pp=2)  # from the checkpoint alone
    reshard(tmp_path / "s2", tmp_path / "r2plan", plan=load_plan(b))  # the program's own plan
    assert read_manifest(tmp_path / "r2")["layout_hash"] == read_manifest(tmp_path / "r2plan")["layout_hash"]

    resumed = tools.torchrun(b, 2, "--train", "--steps", "4", "--resume", str(tmp_path / "r2"),
                             "--save", str(tmp_path / "r4"))
    tools.check_exit(resumed)
    reshard(tmp_path / "r2", tmp_path / "r2dp", pp=1)
    fsdp = tools.torchrun(c, 2, "--train", "--steps", "4", "--resume", str(tmp_path / "r2dp"))
    tools.check_exit(fsdp)
    u, r = losses(full.stdout), {**losses(half.stdout), **losses(resumed.stdout)}
    assert sorted(r) == [1, 2, 3, 4] and sorted(u) == [1, 2, 3, 4]
    assert sorted(losses(fsdp.stdout)) == [3, 4]
    for other in (r, {**r, **losses(fsdp.stdout)}):
        for step in (1, 2, 3, 4):  # other layouts reorder reductions, fp32
            assert abs(u[step] - other[step]) <= 1e-5 * max(1.0, abs(u[step])), (step, u, other)
    want, got = load_full(tmp_path / "u4"), load_full(tmp_path / "r4")
    assert want.keys() == got.keys() and len(want) > 0
    for k in want:  # Adam turns rounding noise of near-zero gradients (attention k biases)
        # into ~1e-6 parameter differences between layouts (cf. verify.optimizer); lr is 3e-4
        assert torch.allclose(want[k], got[k], rtol=1e-5, atol=1e-5), k
    want, got = load_full(tmp_path / "u4", optim=True), load_full(tmp_path / "r4", optim=True)
    assert want.keys() == got.keys() and len(want) > 0
    for kind in ("exp_avg", "exp_avg_sq", "step"):
        # moments of gradients that are rounding noise (attention k biases) differ at the noise
        # level between layouts: tolerance relative to the largest moment of that kind
        scale = max(float(v.abs().max()) for k, v in want.items() if k.endswith("." + kind))
        for k in (k for k in want if k.endswith("." + kind)):
            assert torch.allclose(want[k], got[k], rtol=1e-4, atol=1e-4 * scale), k


ZBV = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "pipeline.schedule=zbv", "pipeline.virtual_stages=2")


@pytest.mark.precompile("llama", *ZBV)
def test_resume_with_two_stages_per_rank_is_bit_exact(compiled, tools, tmp_path):
    """ZB-V, 4 stages on 2 ranks, the tied embedding (stage 0) and LM head (stage 3) on rank
    0: each local stage's AdamW state is saved to and resumed from its own stage file; 2 + 2
    resumed steps == 4 uninterrupted steps bit-exactly (same layout, same reduction order)."""
    out = compiled("llama", *ZBV)
    full = tools.torchrun(out, 2, "--train", "--steps", "4", "--save", str(tmp_path / "u4"))
    tools.check_exit(full)
    half = tools.torchrun(out, 2, "--train", "--steps", "2", "--save", str(tmp_path / "s2"))
    tools.check_exit(half)
    manifest = read_manifest(tmp_path / "s2")
    assert manifest["num_stages"] == 4 and manifest["train"]["step"] == 2
    tied = [c["file"] for p in manifest["tensors"]["optim.model.embed_tokens.weight.exp_avg"]["pieces"]
            for c in p["chunks"]]
    assert tied == ["pp0-tp0-dp0.safetensors", "pp3-tp0-dp0.safetensors"]
    resumed = tools.torchrun(out, 2, "--train", "--steps", "4", "--resume", str(tmp_path / "s2"),
                             "--save", str(tmp_path / "r4"))
    tools.check_exit(resumed)
    u, r = losses(full.stdout), {**losses(half.stdout), **losses(resumed.stdout)}
    assert sorted(u) == sorted(r) == [1, 2, 3, 4] and u == r, (u, r)
    for optim in (False, True):
        want, got = load_full(tmp_path / "u4", optim=optim), load_full(tmp_path / "r4", optim=optim)
        assert want.keys() == got.keys() and len(want) > 0
        for k in want:
            assert torch.equal(want[k], got[k]), k
    start, end = load_full(tmp_path / "s2"), load_full(tmp_path / "r4")
    assert not torch.equal(start["model.embed_tokens.weight"], end["model.embed_tokens.weight"])
