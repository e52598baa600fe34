"""Convert a checkpoint between (tp, pp) layouts without the model: ``parallelize reshard``.

Each output piece is assembled from lazily read regions of the input
(:func:`parallelizer.checkpoint.reader.load_tensor`, ``safe_open(...).get_slice``) and
streamed to its file (:mod:`parallelizer.checkpoint.stream`), so peak memory is about two
output pieces plus the regions read for them, never the model. Every input file's size is
checked against the manifest first; the sha256 checks of the inputs run in the same thread
pool as the writing of the output files (one file per thread; hashing, copies and writes
release the GIL), and nothing is published unless every check passed. The output is
written into a hidden temporary sibling of DST, fsynced, and renamed onto DST when
complete; SRC is only read.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from parallelizer.checkpoint.reader import (check_file_sha256, check_file_size, load_tensor,
                                            read_manifest, verify_file)
from parallelizer.convert.target import plan_layout, target_layout
from parallelizer.checkpoint.writer import FileLayout, write_layout
from parallelizer.checkpoint.publish import check_destination
from parallelizer.errors import CheckpointError
from parallelizer.plan.layouts import segments


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar counting bytes (stderr), or a no-op when disabled or when stderr is not a
    terminal (a log file would collect every redrawn frame)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                disable=None if enabled else True, leave=False)


def cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def verify_all(src: Path, manifest: dict, show: bool = False) -> int:
    """Check every file of ``src`` against the manifest; returns the bytes checked.

    Raises:
        CheckpointError: as :func:`parallelizer.checkpoint.reader.verify_file`.
    """
    total = sum(f["bytes"] for f in manifest["files"].values())
    names = sorted(manifest["files"])
    with progress_bar(total, "verify sha256", show) as bar, \
            ThreadPoolExecutor(min(len(names), os.cpu_count() or 1) or 1) as pool:
        # hashlib releases the GIL: files are hashed in parallel; errors in file order
        for name, _ in zip(names, pool.map(lambda n: verify_file(src, n, manifest), names)):
            bar.update(manifest["files"][name]["bytes"])
    return total


def plural(n: int, word: str) -> str:
    """``1 file``, ``4 files``: counts in progress descriptions and summaries."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_paths(src: Path, dst: Path, force: bool) -> None:
    """DST must not be SRC, inside it or a folder holding it (``--force`` would delete the
    source with it), and must not exist unless ``force``.

    Raises:
        CheckpointError: names DST and the fix.
    """
    s, d = Path(src).resolve(), Path(dst).resolve()
    if d == s or s in d.parents or d in s.parents:
        raise CheckpointError(f"destination {dst} is the source {src}, inside it or a folder "
                              f"holding it; write the converted checkpoint to another folder")
    if dst.exists() and not force:
        raise CheckpointError(f"destination {dst} already exists; choose another folder or pass "
                              "--force to replace it (only once the new checkpoint is complete)")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"destination {dst} exists and is not a folder")
    if dst.is_dir():
        check_destination(dst, force)  # before any work: --force replaces only our outputs


def reshard(src, dst, tp: Optional[int] = None, pp: Optional[int] = None, plan=None,
            force: bool = False, show_progress: bool = False, tmp_hook=None,
            threads: Optional[int] = None, virtual_stages: Optional[int] = None,
            ep: Optional[int] = None) -> dict:
    """Write checkpoint ``src`` to ``dst`` in another layout: (``tp``, ``pp``) computed from the
    checkpoint (:func:`parallelizer.convert.target.target_layout`; None keeps the source
    degree), or exactly the layout of a compiled program's ``plan`` (ParallelPlan).

    ``virtual_stages`` (pipeline stages per pp rank, as ``pipeline.virtual_stages``) makes
    ``pp x virtual_stages`` stages; None keeps the source's stages when pp is unchanged, else 1.
    Optimizer state stored with the parameters is converted with them. ``threads`` (default:
    the machine's cores) hash input files and write output files in parallel. ``ep`` records
    the expert weights for that ep degree (files hold every expert whatever it is; a
    per-rank save's expert rows, one ep rank's each, are merged like any chunks).

    Returns:
        ``{"bytes_read", "bytes_written", "seconds", "files"}``.

    Raises:
        CheckpointError: bad paths (:func:`check_paths`); SRC missing, corrupt, truncated or
            of another format; a degree that does not fit a tensor (names it and the degrees
            that do); a plan of another model.
    """
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    manifest = read_manifest(src)
    check_paths(src, dst, force)
    names = sorted(manifest["files"])
    for name in names:
        check_file_size(src, name, manifest)
    read = sum(manifest["files"][n]["bytes"] for n in names)
    if plan is not None:
        layout = plan_layout(manifest, plan)
    else:
        mesh = manifest["mesh"]
        layout = target_layout(manifest, tp or mesh["tp"], pp or mesh["pp"],
                               virtual_stages=virtual_stages, ep=ep)
    total = sum(_numel(s) * torch.empty((), dtype=dt).element_size()
                for p, t in layout.files() for _, s, dt in layout.file_specs(p, t))
    pool = ThreadPoolExecutor(threads or cores(), thread_name_prefix="reshard")
    try:
        with progress_bar(read + total, f"verify + reshard -> tp={layout.mesh['tp']} "
                          f"pp={layout.mesh['pp']} ({plural(layout.stages(), 'stage')})", show_progress) as bar:
            def check(name: str) -> None:
                check_file_sha256(src, name, manifest)
                bar.update(manifest["files"][name]["bytes"])

            write_layout(layout, lambda name, t: target_piece(src, manifest, layout, name, t), dst,
                         overwrite=force, progress=bar.update, tmp_hook=tmp_hook, pool=pool,
                         checks=[partial(check, n) for n in names])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {"bytes_read": read, "bytes_written": total, "seconds": time.perf_counter() - t0,
            "files": len(layout.files())}


def target_piece(src: Path, manifest: dict, layout: FileLayout, name: str, tp_rank: int) -> torch.Tensor:
    """Tp rank ``tp_rank``'s piece of tensor ``name`` under ``layout``, read from ``src``:
    one lazy region read per segment of the target layout; padding rows zero."""
    tplan = layout.tensors[name]
    d = tplan.tp_dim
    if d is None:
        return load_tensor(src, name, manifest=manifest)
    n, tp = tplan.shape[d], layout.mesh["tp"]
    segs = segments(n, tplan.layout, tp, tp_rank)
    local = tplan.local_shape(tp)
    handles: dict = {}
    try:
        if len(segs) == 1 and segs[0].length == local[d]:
            return load_tensor(src, name, _along(tplan.shape, d, segs[0]), manifest, handles)
        piece = torch.zeros(local, dtype=getattr(torch, tplan.dtype))
        for seg in segs:
            if seg.length:
                piece.narrow(d, seg.piece_offset, seg.length).copy_(
                    load_tensor(src, name, _along(tplan.shape, d, seg), manifest, handles))
        return piece
    finally:
        handles.clear()  # drop the safe_open mappings: resident memory stays one piece


def _along(shape, d: int, seg) -> tuple[slice, ...]:
    return tuple(slice(seg.full_offset, seg.full_offset + seg.length) if i == d else slice(0, n)
                 for i, n in enumerate(shape))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
