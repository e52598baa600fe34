"""Write a state_dict resharded for a ParallelPlan: one safetensors file per (pipeline
stage, tp rank) plus ``manifest.json`` (DESIGN.md §4).

Layout of ``out_dir``::

    pp0-tp0.safetensors  pp0-tp1.safetensors  ...   one per (stage, tp); dp replicas share them
    manifest.json

``pp{s}`` is the pipeline *stage* index ``s`` in ``[0, pp * virtual_stages)``; it equals the
pp rank when each rank runs one stage, and a rank running several stages (interleaved,
ZB-V schedules) reads one file per stage. Each file holds, under its canonical fqn, the tp
piece of every tensor whose plan ``stages`` include stage ``s`` (a tensor tied across stages
is stored in each of them). The manifest::

    {"format_version": 1, "plan_hash": ..., "mesh": {"pp", "dp", "tp"}, "num_stages": ...,
     "tensors": {fqn: {"shape", "dtype", "is_buffer",
                       "pieces": [{"file", "name", "dim", "offset", "length"}, ...]}},
     "aliases": {alias fqn: canonical fqn}, "files": {file name: sha256 hex}}

``pieces`` lists every stored copy: a piece is the slice ``[offset, offset + length)`` of the
full tensor along ``dim``; a replicated tensor's pieces have ``dim``/``length`` null and
``offset`` 0. Copies with the same offset (other pp stages, or other tp ranks of a
replicated tensor) hold identical bytes.

The write is atomic: everything goes to a hidden sibling folder, is fsynced, then renamed
onto ``out_dir``; a reader never sees a partial checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from parallelizer.checkpoint.layout import local_piece, normalize_dim, shard_range
from parallelizer.errors import CheckpointError
from parallelizer.plan import ParallelPlan, TensorPlan

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def shard_file_name(stage: int, tp_rank: int) -> str:
    """``pp{s}-tp{t}.safetensors``: the file of pipeline stage ``s`` and tp rank ``t``."""
    return f"pp{stage}-tp{tp_rank}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32`` (the spelling TensorPlan.dtype uses)."""
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_checkpoint(state_dict: dict[str, torch.Tensor], plan: ParallelPlan, out_dir: Path,
                     overwrite: bool = False) -> Path:
    """Write ``state_dict`` in the plan's (stage, tp) layout to ``out_dir``.

    Args:
        state_dict: canonical fqn -> full tensor (shape and dtype as in the plan); entries
            under alias fqns of ``plan.aliases`` are ignored.
        plan: the ParallelPlan; ``plan.mesh`` gives pp and tp, ``plan.tensors`` the placements.
        out_dir: destination folder; must not exist or be empty unless ``overwrite``.
        overwrite: replace an existing non-empty ``out_dir``, only once the new one is complete.

    Returns:
        ``out_dir``.

    Peak memory: the state_dict plus the pieces of one (stage, tp) file.

    Raises:
        CheckpointError: ``out_dir`` exists and is not empty (without ``overwrite``) or is a
            file; a plan tensor is missing from ``state_dict`` or has another shape or dtype;
            ``state_dict`` holds tensors the plan does not know.
    """
    out_dir = Path(out_dir)
    _check_destination(out_dir, overwrite)
    _check_state_dict(state_dict, plan)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        files = {}
        for p in range(plan.num_stages):
            for t in range(plan.mesh["tp"]):
                files[shard_file_name(p, t)] = _write_shard(state_dict, plan, p, t, tmp)
        manifest = build_manifest(plan, files)
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def build_manifest(plan: ParallelPlan, files: dict[str, str]) -> dict:
    """The manifest dict for ``plan`` given ``files`` (file name -> sha256 hex)."""
    tp = plan.mesh["tp"]
    tensors = {}
    for fqn, tplan in sorted(plan.tensors.items()):
        d = normalize_dim(tplan.tp_dim, len(tplan.shape))
        pieces = []
        for p in sorted(set(tplan.stages)):
            for t in range(tp):
                offset, length = (0, None) if d is None else shard_range(tplan.shape[d], tp, t)
                pieces.append({"file": shard_file_name(p, t), "name": fqn, "dim": d,
                               "offset": offset, "length": length})
        tensors[fqn] = {"shape": list(tplan.shape), "dtype": tplan.dtype,
                        "is_buffer": tplan.is_buffer, "pieces": pieces}
    return {"format_version": FORMAT_VERSION, "plan_hash": plan.hash(), "mesh": dict(plan.mesh),
            "num_stages": plan.num_stages,
            "tensors": tensors, "aliases": dict(sorted(plan.aliases.items())), "files": files}


def _write_shard(state_dict, plan: ParallelPlan, p: int, t: int, folder: Path) -> str:
    """Write file (p, t) into ``folder``, fsync it, and return its sha256."""
    tp = plan.mesh["tp"]
    pieces = {fqn: local_piece(state_dict[fqn], tplan, tp, t)
              for fqn, tplan in sorted(plan.tensors.items()) if p in tplan.stages}
    path = folder / shard_file_name(p, t)
    save_file(pieces, str(path), metadata={"format": "pt", "plan_hash": plan.hash(),
                                           "stage": str(p), "tp_rank": str(t)})
    del pieces
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return sha256_file(path)


def _check_destination(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"checkpoint destination {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"checkpoint destination {out_dir} exists and is not empty; choose another folder "
            "or pass overwrite=True to replace it")


def _check_state_dict(state_dict: dict, plan: ParallelPlan) -> None:
    """Every plan tensor present with the plan's shape and dtype; nothing unknown besides aliases."""
    missing = sorted(set(plan.tensors) - set(state_dict))
    unknown = sorted(set(state_dict) - set(plan.tensors) - set(plan.aliases))
    wrong = [f"{fqn}: plan {tplan.shape} {tplan.dtype} vs tensor "
             f"{tuple(state_dict[fqn].shape)} {dtype_name(state_dict[fqn].dtype)}"
             for fqn, tplan in sorted(plan.tensors.items()) if fqn in state_dict
             and not _agrees(state_dict[fqn], tplan)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} plan tensor(s) missing from the state_dict: {_few(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} state_dict tensor(s) not in the plan: {_few(unknown)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) differ from the plan: {_few(wrong)}")
    if problems:
        raise CheckpointError("cannot write checkpoint: " + "; ".join(problems)
                              + "; the state_dict must be keyed by the plan's canonical fqns")
    for fqn, tplan in plan.tensors.items():
        d = normalize_dim(tplan.tp_dim, len(tplan.shape))
        assert d is None or tplan.shape[d] % plan.mesh["tp"] == 0, (
            f"{fqn}: tp {plan.mesh['tp']} does not divide dim {d} of {tplan.shape}")
        assert tplan.stages and all(0 <= p < plan.num_stages for p in tplan.stages), (
            f"{fqn}: stages {tplan.stages} not in [0, {plan.num_stages})")


def _agrees(tensor: torch.Tensor, tplan: TensorPlan) -> bool:
    return tuple(tensor.shape) == tuple(tplan.shape) and dtype_name(tensor.dtype) == tplan.dtype


def _few(items: list, n: int = 5) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` onto ``out_dir``; an old non-empty ``out_dir`` (only with
    ``overwrite``) is moved aside first and deleted after the rename."""
    _check_destination(out_dir, overwrite)  # again: someone may have written meanwhile
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
    _fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
