"""Periodic checkpoints and restart: ``run.py --train --save DIR --save-every N --keep K``
and ``--resume auto``.

With ``--save-every``, ``DIR`` is a checkpoint *folder*: ``DIR/step-00000004`` is the
complete checkpoint after step 4 (manifest written last, folder renamed into place:
runtime/sharded_save.py), ``DIR/.step-00000006.partial`` a save that a failure interrupted.
``--keep K`` deletes all but the K newest complete checkpoints after each save.
``--resume auto`` continues from the newest complete checkpoint of ``DIR`` (or starts from
the program's weights when there is none), naming every incomplete one it skips; under
``torchrun --max-restarts R`` the restarted ranks rerun the same command line and so pick up
the last complete save (the data position and RNG state are restored with it, so the losses
equal an uninterrupted run's).
"""
from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path

import torch

from . import rng

from ..checkpoint.format import MANIFEST
from ..errors import UserError

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_PARTIAL = re.compile(r"^\.step-(\d{8})\.partial$")
FAULT_ENV = "PARALLELIZER_FAULT_AFTER_RANK_FILES"
DISK_FULL_ENV = "PARALLELIZER_FAULT_DISK_FULL"


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


def scan(folder: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """``(complete, incomplete)`` checkpoints of ``folder``: complete ones as (step, path)
    sorted by step; incomplete ones are step folders without a manifest and ``.partial``
    folders left by an interrupted save."""
    complete, incomplete = [], []
    if not Path(folder).is_dir():
        return complete, incomplete
    for p in sorted(Path(folder).iterdir()):
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            complete.append((int(m.group(1)), p))
        elif m or _PARTIAL.match(p.name):
            incomplete.append(p)
    return sorted(complete), incomplete


def check_periodic_folder(folder: Path, resumed_step: int | None = None) -> None:
    """``--save DIR`` with ``--save-every``: DIR may hold only step checkpoints, and only
    of this run: none newer than ``resumed_step`` (the step of the checkpoint resumed
    from; None for a run that resumes from nothing, -1 for ``--resume auto``, which
    continues the newest), since ``--keep`` deletes by step number and would delete the
    run's own new checkpoints and the older run's alike.

    Raises:
        UserError: DIR is a file, a compiled program, a single checkpoint, holds other files,
            or holds another run's step checkpoints.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--save {folder}: a file is in the way; pass a folder for --save-every")
    if not folder.is_dir():
        return
    if (folder / "plan.json").exists() or (folder / MANIFEST).exists():
        raise UserError(f"--save {folder} with --save-every: that folder is a compiled program or a "
                        "single checkpoint; --save-every writes step-NNNNNNNN checkpoints into a "
                        "folder of their own; pass a new or empty folder")
    other = [p.name for p in folder.iterdir()
             if not (_STEP_DIR.match(p.name) or _PARTIAL.match(p.name))]
    if other:
        raise UserError(f"--save {folder} with --save-every: the folder holds {sorted(other)[:3]}, "
                        "which are not step-NNNNNNNN checkpoints; pass a new or empty folder")
    newer = [s for s, _ in scan(folder)[0] if resumed_step is None or s > resumed_step >= 0]
    if newer:
        since = "a run that resumes from none" if resumed_step is None else \
            f"a run resumed at step {resumed_step}"
        raise UserError(
            f"--save {folder} with --save-every: the folder holds the step checkpoints of another "
            f"run (steps {', '.join(map(str, newer[:4]))}{' ...' if len(newer) > 4 else ''}), "
            f"and {since} would mix its own with them (--keep deletes by step number, --resume "
            f"auto takes the newest); continue that run with --resume auto, or pass a new or "
            f"empty folder")


def resolve_auto(folder: Path | None, log) -> Path | None:
    """The newest complete checkpoint of ``folder`` for ``--resume auto`` (None: there is
    none, start from the program's weights); ``log(text)`` names each incomplete one skipped.

    Raises:
        UserError: ``--resume auto`` without ``--save DIR --save-every N``.
    """
    if folder is None:
        raise UserError("--resume auto looks for the newest complete checkpoint of the --save "
                        "folder; pass --save DIR --save-every N with it")
    complete, incomplete = scan(folder)
    newest = complete[-1][0] if complete else -1
    for p in incomplete:
        log(f"resume auto: ignoring incomplete checkpoint {p} (no {MANIFEST}: a save "
            "interrupted by a failure); it is deleted by the next save")
    if not complete:
        log(f"resume auto: no complete checkpoint in {folder}; starting from the program's weights")
        return None
    log(f"resume auto: continuing from {complete[-1][1]} (step {newest})")
    return complete[-1][1]


def prune(folder: Path, keep: int | None, log) -> None:
    """Delete all but the ``keep`` newest complete checkpoints and every incomplete one
    older than the newest complete checkpoint (call on one rank, after a save)."""
    complete, incomplete = scan(folder)
    newest = complete[-1][0] if complete else -1
    doomed = [p for _, p in complete[:-keep]] if keep else []
    doomed += [p for p in incomplete if int(re.search(r"(\d{8})", p.name).group(1)) <= newest]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        log(f"removed {'incomplete ' if p in incomplete else ''}checkpoint {p}")


def rng_state(device: torch.device, mesh: dict) -> dict:
    """This rank's RNG states as JSON data for the manifest's ``train.rng`` (no pickle):
    ``{"torch": base64 of the CPU (and current GPU) default generator, "dropout": {"<stream>.<device>":
    base64} of the dropout streams (``runtime/rng.py``), "mesh": the plan's mesh}``."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return {"torch": ";".join(_b64(p) for p in parts), "mesh": dict(mesh),
            "dropout": {k: _b64(v) for k, v in rng.state_dict().items()}}


def set_rng_state(entry: dict, device: torch.device, mesh: dict) -> bool:
    """Restore a :func:`rng_state` entry saved on the same mesh; returns whether it did (a
    checkpoint resharded to another mesh holds no state for this rank's streams)."""
    if entry.get("mesh") != dict(mesh):
        return False
    parts = [_unb64(t) for t in entry["torch"].split(";")]
    torch.set_rng_state(parts[0])
    if device.type == "cuda" and len(parts) > 1:
        torch.cuda.set_rng_state(parts[1], device)
    rng.load_state_dict({k: _unb64(v) for k, v in entry.get("dropout", {}).items()
                         if k.endswith("." + device.type)})
    return True


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.numpy())).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def fault_after_rank_files(step: int, rank: int) -> None:
    """Test hook for the restart test: ``PARALLELIZER_FAULT_AFTER_RANK_FILES=STEP:RANK``
    makes global rank RANK SIGKILL itself after writing its files of the step-STEP save and
    before the manifest exists, in the first incarnation of a torchrun job only
    (``TORCHELASTIC_RESTART_COUNT`` 0): a real crash mid-save, leaving a half-written one."""
    want = os.environ.get(FAULT_ENV)
    if want and want == f"{step}:{rank}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        import signal
        print(f"fault injection: rank {rank} kills itself (SIGKILL) during the step-{step} save",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def fault_disk_full(step: int | None, rank: int, path: Path) -> None:
    """Test hook for a full disk: ``PARALLELIZER_FAULT_DISK_FULL=STEP:RANK`` makes global rank
    RANK's file of the step-STEP save a symlink to ``/dev/full`` before it is written, so the
    write fails with the kernel's own ENOSPC ("No space left on device"), as on a full disk."""
    if step is not None and os.environ.get(DISK_FULL_ENV) == f"{step}:{rank}":
        Path(path).symlink_to("/dev/full")
