"""--save-every / --keep / --resume auto in one process: the argument errors (raised before
any process group), the folder scan that tells complete from half-written checkpoints,
pruning, and the RNG state round trip."""
from __future__ import annotations

import pytest
import torch

from parallelizer.errors import UserError
from parallelizer.runtime.main import _parser, _periodic_args_error
from parallelizer.runtime.periodic import (check_periodic_folder, prune, resolve_auto, rng_state,
                                           scan, set_rng_state, step_dir)


def _error(*argv):
    return _periodic_args_error(_parser().parse_args(list(argv)))


def _ckpt(folder, step, complete=True):
    d = step_dir(folder, step) if complete else folder / f".step-{step:08d}.partial"
    d.mkdir(parents=True)
    (d / "pp0-tp0-dp0.safetensors").write_bytes(b"x")
    if complete:
        (d / "manifest.json").write_text("{}")
    return d


def test_argument_errors_name_the_flag_and_fix(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "not step-NNNNNNNN checkpoints" in _error("--train", "--save", str(tmp_path / "busy"),
                                                      "--save-every", "2")
    assert "--resume auto needs --save DIR --save-every N" in _error("--train", "--resume", "auto")
    assert "--keep needs --save-every N" in _error("--train", "--save", str(tmp_path / "n"), "--keep", "2")
    assert "go with --train --save DIR" in _error("--verify", "--save-every", "2")
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "manifest.json").write_text("{}")
    assert "single checkpoint" in _error("--train", "--save", str(tmp_path / "single"), "--save-every", "1")
    assert _error("--train", "--save", str(tmp_path / "new"), "--save-every", "2", "--keep", "1",
                  "--resume", "auto") is None
    with pytest.raises(SystemExit):
        _parser().parse_args(["--train", "--save-every", "0"])
    assert _error("--verify", "--log-every", "1", "--batch-size", "4") == \
        "--batch-size, --log-every go(es) with --train"
    for flag in ("--batch-size", "--seq-len", "--log-every", "--eval-every"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--train", flag, "0"])


def test_scan_resolve_and_prune(tmp_path, capsys):
    log = []
    assert resolve_auto(tmp_path / "none", log.append) is None and "no complete checkpoint" in log[-1]
    for s in (2, 4, 6):
        _ckpt(tmp_path, s)
    half = _ckpt(tmp_path, 8, complete=False)
    no_manifest = step_dir(tmp_path, 10)
    no_manifest.mkdir()
    complete, incomplete = scan(tmp_path)
    assert [s for s, _ in complete] == [2, 4, 6] and incomplete == [half, no_manifest]
    log.clear()
    assert resolve_auto(tmp_path, log.append) == step_dir(tmp_path, 6)
    assert any(str(half) in line and "incomplete" in line for line in log)
    assert any(str(no_manifest) in line for line in log)
    check_periodic_folder(tmp_path, -1)  # only step checkpoints, continued by --resume auto
    prune(tmp_path, 2, log.append)  # keeps 4 and 6; the partial newer than 6 stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step-00000008.partial", "step-00000004", "step-00000006", "step-00000010"]
    with pytest.raises(UserError, match="--resume auto looks for"):
        resolve_auto(None, log.append)


def test_rng_state_round_trip():
    torch.manual_seed(3)
    torch.rand(5)
    mesh = {"pp": 1, "dp": 2, "tp": 1}
    saved = rng_state(torch.device("cpu"), mesh)
    want = torch.rand(7)
    torch.manual_seed(99)
    assert set_rng_state(saved, torch.device("cpu"), mesh)
    assert torch.equal(torch.rand(7), want)
    torch.manual_seed(99)
    assert not set_rng_state(saved, torch.device("cpu"), {**mesh, "dp": 1})  # another mesh
    assert not torch.equal(torch.rand(7), want)


def test_incomplete_checkpoint_named_with_the_fix(tmp_path):
    from parallelizer.checkpoint import read_manifest
    from parallelizer.errors import CheckpointError
    half = _ckpt(tmp_path, 4, complete=False)
    with pytest.raises(CheckpointError, match=r"\.step-00000004\.partial/manifest.json does not exist.*"
                                              r"an incomplete checkpoint.*--resume auto"):
        read_manifest(half)


def test_a_run_not_resuming_refuses_a_folder_with_another_runs_step_checkpoints(tmp_path):
    """A new run (or one resumed at an older step) saving every N steps into a folder with
    an earlier run's step-NNNNNNNN checkpoints: --keep deleted by step number, so the new
    run's own checkpoints went first and two of the earlier run's after them (exit 0, none
    of its own kept; a break test). Refused before any process group; --resume auto, and
    a resume from the newest step, continue the series."""
    root = tmp_path / "ckpts"
    for step in (3, 6, 10):
        _ckpt(root, step)
    error = _error("--train", "--steps", "4", "--save", str(root), "--save-every", "2",
                   "--keep", "2")
    assert error.startswith(f"--save {root} with --save-every: the folder holds the step "
                            f"checkpoints of another run (steps 3, 6, 10)"), error
    assert "continue that run with --resume auto, or pass a new or empty folder" in error
    old = step_dir(root, 6)
    (old / "manifest.json").write_text('{"train": {"step": 6}}')
    assert "(steps 10)" in _error("--train", "--save", str(root), "--save-every", "2",
                                  "--resume", str(old))
    assert _error("--train", "--save", str(root), "--save-every", "2", "--resume", "auto") is None
    (step_dir(root, 10) / "manifest.json").write_text('{"train": {"step": 10}}')
    assert _error("--train", "--save", str(root), "--save-every", "2",
                  "--resume", str(step_dir(root, 10))) is None
