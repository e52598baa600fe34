"""Atomic publishing of a folder (a checkpoint, an exported Hugging Face folder): everything
is written into a hidden temporary sibling, fsynced, then renamed onto the destination, so
a reader never sees a partial folder and a killed writer leaves only ``.<name>.tmp-*``.
Used by the writer, ``export`` and the per-rank saves of ``run.py``."""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from parallelizer.errors import CheckpointError


def check_destination(out_dir: Path, overwrite: bool) -> None:
    """Raise CheckpointError when ``out_dir`` is a file, a non-empty folder without
    ``overwrite``, or (even with it) a folder holding files parallelizer does not write
    there (:func:`foreign_files`: a compiled program, a model's config and tokenizer, notes);
    names the folder, what it holds and the fix."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"checkpoint destination {out_dir} exists and is not a folder")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise CheckpointError(
            f"checkpoint destination {out_dir} exists and is not empty; choose another folder "
            "or pass --force (overwrite=True) to replace it")
    other = foreign_files(out_dir)
    if other:
        raise CheckpointError(
            f"checkpoint destination {out_dir} holds {', '.join(other[:3])}"
            f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}, which is no "
            f"checkpoint or export parallelizer wrote; --force replaces only those: choose "
            f"another folder")


def foreign_files(folder: Path) -> list[str]:
    """What in ``folder`` a checkpoint (manifest.json and its files) or an export (only
    ``*.safetensors`` and ``*.json`` files) would not hold: sub-folders, other files; [] when
    replacing it loses nothing parallelizer did not write."""
    entries = sorted(folder.iterdir())
    if (folder / "manifest.json").is_file() and not (folder / "plan.json").exists():
        return [p.name for p in entries if p.is_dir()]
    return [p.name + ("/" if p.is_dir() else "") for p in entries
            if p.is_dir() or p.suffix not in (".safetensors", ".json")
            or p.name == "plan.json"]


def temp_sibling(out_dir: Path) -> Path:
    """A new hidden temporary folder beside ``out_dir``, to be renamed onto it when complete,
    with the permissions a plain ``mkdir`` would give (``0o777 & ~umask``): ``mkdtemp``'s
    0o700 would survive the rename and hide the output from the user's group. Its name
    carries the writer's pid and host, so that the next write to ``out_dir`` removes what a
    killed writer left (:func:`remove_stale_temps`)."""
    remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent,
                                prefix=f".{out_dir.name}.tmp-{os.getpid()}@{_host()}-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def remove_stale_temps(out_dir: Path) -> list[Path]:
    """Remove the temporary siblings of ``out_dir`` that a killed writer left (SIGKILL, a
    lost node: no ``finally`` ran): those named with this host and a pid no process has. A
    live pid (a concurrent writer), another host's or an unnamed one is left alone. Prints
    one line per folder removed; returns them."""
    pattern = re.compile(rf"^\.{re.escape(out_dir.name)}\.tmp-(\d+)@(.+)-[^-]+$")
    removed = []
    if not out_dir.parent.is_dir():
        return removed
    for p in sorted(out_dir.parent.iterdir()):
        m = pattern.match(p.name)
        if m and p.is_dir() and m.group(2) == _host() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            print(f"removed {p}, left by an interrupted write (pid {m.group(1)})",
                  file=sys.stderr)
            removed.append(p)
    return removed


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    """fsync an already written file (its inode's dirty pages, through any fd)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """fsync a folder: its entries (created, renamed files) reach the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` onto ``out_dir``; an old non-empty ``out_dir`` (only with
    ``overwrite``) is moved aside first and deleted after the rename.

    Raises:
        CheckpointError: from :func:`check_destination` (checked again: someone may have
            written meanwhile).
    """
    check_destination(out_dir, overwrite)
    old = None
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            os.rename(out_dir, old / "ckpt")
        else:
            out_dir.rmdir()
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.rename(old / "ckpt", out_dir)
            old.rmdir()
        raise
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
