"""mixed_precision.param_dtype beyond FSDP2: under zero_stage 0/1 and tp/pp-only layouts the
stages run under torch.autocast with fp32 master weights (runtime/data_parallel.py).

- bf16 at tp2 x pp2 (sequence parallelism's fused linears included) passes --verify against
  the fp32 model at bf16's tolerances, as the FSDP2 path does (runtime/verify.py);
- fp16 at dp2 under DDP trains with a dynamic loss scale whose state is saved and resumed:
  steps 3 and 4 after a resume equal the uninterrupted run's bit for bit.
"""
from __future__ import annotations

import re

import pytest

from parallelizer.checkpoint import read_manifest

BF16 = ("mesh.dp=1", "mesh.tp=2", "mesh.pp=2", "zero_stage=0", "mixed_precision.param_dtype=bf16")
FP16 = ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "zero_stage=0", "mixed_precision.param_dtype=fp16",
        "pipeline.microbatches=1")
_STEP = re.compile(r"^(step \d+ loss \S+)$", re.M)


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt", *BF16)
def test_bf16_under_ddp_layouts_passes_verify(compiled, tools):
    res = tools.torchrun(compiled("gpt", *BF16), 4, "--verify")
    assert "param_dtype bf16, reduce_dtype fp32, atol=0.03 rtol=0.03 (tolerances for bf16)" in res.stdout
    assert res.stdout.rstrip().endswith("PASS"), res.explain()
    tools.check_exit(res)


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt_bytes", *FP16)
def test_fp16_loss_scale_is_resumed(compiled, tools, tmp_path):
    out = compiled("gpt_bytes", *FP16)
    full = tools.torchrun(out, 2, "--train", "--steps", "4", "--save", str(tmp_path / "ck"),
                          "--save-every", "2")
    tools.check_exit(full)
    scale = read_manifest(tmp_path / "ck" / "step-00000002")["train"]["loss_scale"]
    assert scale["scale"] >= 1.0 and scale["good_steps"] >= 0, scale
    resumed = tools.torchrun(out, 2, "--train", "--steps", "4", "--resume", str(tmp_path / "ck" / "step-00000002"))
    tools.check_exit(resumed)
    want, got = _STEP.findall(full.stdout), _STEP.findall(resumed.stdout)
    assert len(want) == 4 and got == want[2:], (full.stdout, resumed.stdout)
