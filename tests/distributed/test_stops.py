"""run.py --train stops cleanly: at a non-finite loss (naming the step, the rank and the
first parameter whose gradient is not finite, keeping the last complete checkpoint), and
when a save cannot be written (a real ENOSPC: the rank's file is a symlink to /dev/full,
runtime/periodic.py's fault hook), leaving the previous checkpoint intact and saying what
failed. Both exit with their own status on every rank, the process group shut down."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallelizer.checkpoint import load_full, read_manifest

USER = Path(__file__).parent / "user_models"
PP2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "pipeline.microbatches=2")
DP2 = ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "pipeline.microbatches=1")


@pytest.mark.timeout(300)
def test_non_finite_loss_stops_at_that_step(tools, tmp_path):
    out = tmp_path / "out"
    res = tools.parallelize(USER / "diverging.py", USER / "spec.yaml", out, *PP2)
    assert res.code == 0, res.explain()
    ck = tmp_path / "ck"
    res = tools.torchrun(out, 2, "--train", "--steps", "6", "--save", str(ck), "--save-every", "2")
    assert res.code == 3, res.explain()
    assert tools.step_losses(res.stdout)[:2] and "step 3 loss" not in res.stdout
    err = [line for line in res.stderr.splitlines() if line.startswith("run.py: error")]
    assert err == [
        "run.py: error (rank 0): step 3: the loss is nan; the first non-finite gradient is on rank 0 "
        "(pp 0, dp 0, tp 0), in 0.weight; stopped before the optimizer step (nothing of step 3 "
        "applied). Lower optimizer.lr, set optimizer.max_norm, or check the data; the last complete "
        f"checkpoint is {ck / 'step-00000002'} (step 2)"], res.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002"]


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt", *DP2)
def test_a_failed_save_keeps_the_previous_checkpoint(compiled, tools, tmp_path):
    out = compiled("gpt", *DP2)
    ck = tmp_path / "ck"
    res = tools.torchrun(out, 2, "--train", "--steps", "4", "--save", str(ck), "--save-every", "2",
                         env={"PARALLELIZER_FAULT_DISK_FULL": "4:1"})
    assert res.code == 4, res.explain()
    assert len(tools.step_losses(res.stdout)) == 4
    err = [line for line in res.stderr.splitlines() if line.startswith("run.py: error")]
    assert len(err) == 1 and err[0].startswith(f"run.py: error (rank 0): the save to {ck / 'step-00000004'} "
                                               "failed and nothing was published: rank 1 could not write "), err
    print("\n" + err[0])
    assert "pp0-tp0-dp1.safetensors: No space left on device" in err[0]
    assert err[0].endswith(f"the last complete checkpoint is {ck / 'step-00000002'} (step 2)"), err
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002"]  # no half-written one left
    assert read_manifest(ck / "step-00000002")["train"]["step"] == 2
    load_full(ck / "step-00000002")  # complete: every file's sha256 checks

    single = tmp_path / "single"  # --save DIR over an earlier checkpoint: DIR stays as it was
    tools.check_exit(tools.torchrun(out, 2, "--train", "--steps", "1", "--save", str(single)))
    before = load_full(single)
    res = tools.torchrun(out, 2, "--train", "--steps", "2", "--save", str(single),
                         env={"PARALLELIZER_FAULT_DISK_FULL": "2:0"})
    assert res.code == 4 and f"{single} is unchanged; free space or save elsewhere" in res.stderr, res.explain()
    assert read_manifest(single)["train"]["step"] == 1
    after = load_full(single)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not list(tmp_path.glob(".*partial"))
