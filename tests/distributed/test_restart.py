"""Restart after a failure (issue 18): under ``torchrun --max-restarts 1 --save-every 2``
one rank SIGKILLs itself in the middle of the step-4 save (after writing its own files,
before the manifest exists); torchrun restarts the job, ``--resume auto`` skips the
half-written checkpoint (named in the log) and continues from step 2; every printed loss
equals the uninterrupted run's exactly (same layout, same reduction order, data position
and RNG restored). dp=2 under FSDP2 (zero_stage 3): the checkpoints are per-rank shards."""
from __future__ import annotations

import re

import pytest
import torch

from parallelizer.checkpoint import load_full, read_manifest
from parallelizer.runtime.periodic import FAULT_ENV

DP2 = ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1")  # test_resume.py's, compiled once per session
_STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)
ARGS = ("--train", "--steps", "6", "--save-every", "2", "--resume", "auto")


@pytest.mark.precompile("gpt", *DP2)
def test_sigkill_mid_save_restarts_from_last_complete_checkpoint(compiled, tools, tmp_path):
    out = compiled("gpt", *DP2)
    plain = tools.torchrun(out, 2, *ARGS, "--save", str(tmp_path / "u"), "--keep", "2")
    tools.check_exit(plain)
    killed = tools.torchrun(out, 2, *ARGS, "--save", str(tmp_path / "k"),
                            launcher=("--max-restarts", "1"), env={FAULT_ENV: "4:1"})
    tools.check_exit(killed)
    log = killed.stdout
    assert "fault injection: rank 1 kills itself (SIGKILL) during the step-4 save" in log
    assert f"ignoring incomplete checkpoint {tmp_path / 'k' / '.step-00000004.partial'}" in log
    assert f"continuing from {tmp_path / 'k' / 'step-00000002'} (step 2)" in log
    u = [(int(n), x) for n, x in _STEP.findall(plain.stdout)]
    k = [(int(n), x) for n, x in _STEP.findall(log)]
    assert [n for n, _ in u] == [1, 2, 3, 4, 5, 6], plain.stdout
    # steps 3 and 4 ran twice (before the kill and after the restart): same losses
    assert [n for n, _ in k] == [1, 2, 3, 4, 3, 4, 5, 6], log
    assert all(x == dict(u)[n] for n, x in k), (u, k)  # printed to 6 digits: compare tensors too
    assert "resume auto: no complete checkpoint" in plain.stdout  # first run: from the weights
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == ["step-00000004", "step-00000006"]
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]  # no --keep; the partial is gone
    for optim in (False, True):
        want = load_full(tmp_path / "u" / "step-00000006", optim=optim)
        got = load_full(tmp_path / "k" / "step-00000006", optim=optim)
        assert want.keys() == got.keys() and want
        assert all(torch.equal(want[key], got[key]) for key in want)
    m = read_manifest(tmp_path / "k" / "step-00000006")
    assert m["train"]["step"] == m["train"]["data_position"] == 6 and len(m["train"]["rng"]) == 2
