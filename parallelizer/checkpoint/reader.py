"""Read checkpoints written by :mod:`parallelizer.checkpoint.writer` (format in
:mod:`parallelizer.checkpoint.format`).

- :func:`load_shard`: the file of one (stage, tp) coordinate, what a rank loads for each
  pipeline stage it runs (dp replicas share it), checked against the manifest's sha256 and the plan hash.
- :func:`load_tensor`: any region of one logical tensor, read lazily with
  ``safe_open(...).get_slice`` from only the pieces that overlap it, so resharding needs memory
  for the requested region only (docs/checkpoints.md).
- :func:`load_full`: every logical tensor reassembled, for tests and for export.
"""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from parallelizer.checkpoint.format import (FORMAT_VERSION, MANIFEST, OPTIM_PREFIX, layout_hash,
                                            sha256_file, shard_file_name)
from parallelizer.checkpoint.manifest_schema import validate_manifest
from parallelizer.checkpoint.pieces import piece_files, piece_stage, read_region
from parallelizer.errors import CheckpointError
from parallelizer.plan.layouts import copied_heads, layout_from_json, layout_json
from parallelizer.plan.parallel_plan import ParallelPlan


def read_manifest(ckpt_dir) -> dict:
    """The parsed ``manifest.json`` of ``ckpt_dir`` (schema in :mod:`parallelizer.checkpoint.format`).

    Raises:
        CheckpointError: the folder or its manifest is missing, not JSON, of another
            ``format_version``, malformed, or names a file outside the folder
            (:func:`parallelizer.checkpoint.manifest_schema.validate_manifest`; nothing
            else is read first).
    """
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; {ckpt_dir} is not a parallelizer "
                              f"checkpoint{_what_it_is(Path(ckpt_dir))}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version!r}; this parallelizer reads "
                              f"version {FORMAT_VERSION} (rewrite the checkpoint with this version)")
    validate_manifest(ckpt_dir, manifest, path)
    return manifest


def verify_file(ckpt_dir, file_name: str, manifest: dict) -> Path:
    """Path of ``file_name`` after checking it exists and its size and sha256 match the manifest.

    Raises:
        CheckpointError: the file is missing, not listed, truncated (or grown), or its sha256
            differs; names the file.
    """
    path = check_file_size(ckpt_dir, file_name, manifest)
    check_file_sha256(ckpt_dir, file_name, manifest)
    return path


def check_file_size(ckpt_dir, file_name: str, manifest: dict) -> Path:
    """Path of ``file_name`` after checking it exists, is listed and has the manifest's size
    (a stat: cheap, so every file is checked before any is read).

    Raises:
        CheckpointError: the file is missing, not listed, truncated (or grown); names it.
    """
    path = Path(ckpt_dir) / file_name
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (listed in {MANIFEST}); "
                              "copy the complete checkpoint folder or rewrite it")
    expected = manifest["files"].get(file_name)
    if expected is None:
        raise CheckpointError(f"checkpoint file {path} is not listed in {MANIFEST}")
    size = path.stat().st_size
    if size != expected["bytes"]:
        what = "truncated" if size < expected["bytes"] else "larger than written"
        raise CheckpointError(f"checkpoint file {path} is {what}: {size} bytes, {MANIFEST} records "
                              f"{expected['bytes']}; copy it again or rewrite the checkpoint")
    return path


def check_file_sha256(ckpt_dir, file_name: str, manifest: dict) -> None:
    """The sha256 of ``file_name`` is the manifest's (reads the whole file).

    Raises:
        CheckpointError: it differs; names the file and both digests.
    """
    path = Path(ckpt_dir) / file_name
    expected = manifest["files"][file_name]["sha256"]
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt: sha256 {actual} does not match "
                              f"{expected} recorded in {MANIFEST}; copy it again or rewrite "
                              "the checkpoint")


def _what_it_is(folder: Path) -> str:
    """The likely mix-up behind a folder without a manifest, and its fix."""
    if not folder.exists():
        return " (no such folder)"
    if folder.name.endswith(".partial") or re.fullmatch(r"step-\d{8}", folder.name):
        return (": an incomplete checkpoint (a save interrupted by a failure never wrote its "
                "manifest); resume from an earlier complete one, or pass --resume auto to pick "
                "the newest complete checkpoint of the folder")
    if (folder / "checkpoint" / MANIFEST).is_file():
        return f" but a compiled program's folder; its checkpoint is {folder / 'checkpoint'}"
    if folder.is_dir() and any(folder.glob("*.safetensors")) or folder.suffix == ".safetensors":
        return (f" but Hugging Face safetensors; convert them with `parallelize import {folder} "
                f"-o DST --plan OUT` (OUT: a program compiled for the model)")
    return (" (one is written by `parallelize MODEL SPEC -o OUT` as OUT/checkpoint, by "
            "`run.py --train --save DIR`, `parallelize reshard` or `parallelize import`)")


def check_plan(ckpt_dir, manifest: dict, plan: ParallelPlan) -> None:
    """The checkpoint's layout is the plan's (same number of stages, tp and per-tensor
    placement).

    Raises:
        CheckpointError: names the manifest, the first tensor that differs and both values,
            and the reshard command that converts the checkpoint.
    """
    mine = layout_hash(plan.num_stages, plan.mesh["tp"], plan.tensors)
    if manifest.get("layout_hash") == mine:
        return
    m, pm = manifest["mesh"], plan.mesh
    diff = _first_difference(manifest, plan)
    raise CheckpointError(
        f"{Path(ckpt_dir) / MANIFEST} is from another plan: checkpoint mesh pp={m['pp']} tp={m['tp']}"
        f"{_stages(manifest.get('num_stages', m['pp']), m['pp'])}, this program pp={pm['pp']} "
        f"tp={pm['tp']}{_stages(plan.num_stages, pm['pp'])}{diff}; convert it with `parallelize reshard "
        f"{ckpt_dir} -o NEW --plan OUT` (OUT: this program's folder) or load the checkpoint "
        "it was written for")


def _stages(num_stages: int, pp: int) -> str:
    return "" if num_stages == pp else f" ({num_stages} stages, {num_stages // pp} per rank)"


def _first_difference(manifest: dict, plan: ParallelPlan) -> str:
    model = {k: v for k, v in manifest["tensors"].items() if v.get("kind", "model") == "model"}
    extra, missing = sorted(set(model) - set(plan.tensors)), sorted(set(plan.tensors) - set(model))
    if missing or extra:
        return (f"; tensors only in the plan: {missing[:3]}, only in the checkpoint: {extra[:3]}")
    for fqn, tplan in sorted(plan.tensors.items()):
        e = model[fqn]
        for key, ours in (("shape", list(tplan.shape)), ("dtype", tplan.dtype),
                          ("layout", layout_json(tplan.layout)), ("stages", list(tplan.stages))):
            if e[key] != ours:
                return f"; first difference: {fqn} {key} {e[key]} in the checkpoint, {ours} in the plan"
    return ""


def load_shard(ckpt_dir, stage: int, tp_rank: int, plan: Optional[ParallelPlan] = None,
               verify: bool = True, optim: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of the (stage, tp_rank) file: canonical fqn -> local piece.

    Every data-parallel replica at that coordinate loads the same file. A piece has the
    plan's ``local_shape(tp)`` for tensors held by pipeline stage ``stage``.

    Args:
        ckpt_dir: checkpoint folder.
        stage, tp_rank: coordinates in ``[0, num_stages)`` x ``[0, tp)`` of the manifest
            (``num_stages`` = pp x virtual stages; pp when the manifest predates it).
        plan: when given, its layout must be the checkpoint's (:func:`check_plan`).
        verify: check the file's size and sha256 against the manifest (reads the file twice).
        optim: return the optimizer state pieces (``optim.<fqn>.<state>``) instead of the model's.

    Raises:
        CheckpointError: the checkpoint was written for another plan; coordinates out of the
            mesh; the file is missing, corrupt, truncated, unreadable, lacks a tensor the
            manifest lists or holds one of another shape (each names the file and tensor).
    """
    manifest = read_manifest(ckpt_dir)
    if plan is not None:
        check_plan(ckpt_dir, manifest, plan)
    mesh = manifest["mesh"]
    num_stages = manifest.get("num_stages", mesh["pp"])
    if not (0 <= stage < num_stages and 0 <= tp_rank < mesh["tp"]):
        raise CheckpointError(f"(stage {stage}, tp {tp_rank}) is outside the checkpoint's "
                              f"{num_stages} stages x mesh {mesh}")
    want = {pc["name"]: (pc, t["dtype"]) for k, t in manifest["tensors"].items()
            for pc in t["pieces"] if piece_stage(pc) == stage and pc["tp_rank"] == tp_rank
            and k.startswith(OPTIM_PREFIX) == optim}
    files = sorted({n for pc, _ in want.values() for n in piece_files(pc)}
                   or ({shard_file_name(stage, tp_rank)} & set(manifest["files"])))
    for name in files:
        if verify:
            verify_file(ckpt_dir, name, manifest)
    with ExitStack() as stack:
        opened: dict = {}

        def open_file(name: str):
            if name not in opened:
                opened[name] = stack.enter_context(_open(Path(ckpt_dir) / name))
            return opened[name]

        return {k: read_region(pc, tuple(slice(0, n) for n in pc["shape"]), open_file, ckpt_dir, dt)
                for k, (pc, dt) in sorted(want.items())}


def load_tensor(ckpt_dir, fqn: str, index: Optional[tuple[slice, ...]] = None,
                manifest: Optional[dict] = None, handles: Optional[dict] = None,
                check_replicas: bool = True) -> torch.Tensor:
    """Region ``index`` (one ``slice`` per dim, step 1; None = all) of logical tensor ``fqn``.

    Reads, with ``get_slice``, only the overlap of each needed segment of one copy, so memory
    is the size of the result; padding rows of a padded layout are never read. ``handles``
    (file name -> open ``safe_open``) lets a caller reuse open files across calls; without
    it, files are opened for this call and closed (their mappings released) on return.

    With ``check_replicas`` and a ``replicated_heads`` layout (or fused part), every other copy
    of each head in the region is read too and compared byte for byte.

    Returns:
        tensor of the region's shape and the manifest's dtype.

    Raises:
        CheckpointError: ``fqn`` is not in the manifest; its pieces do not tile the tensor;
            a piece has another shape than the manifest says; replicas differ (names the
            tensor, the rows and both files).
    """
    manifest = manifest if manifest is not None else read_manifest(ckpt_dir)
    entry = manifest["tensors"].get(fqn)
    if entry is None:
        raise CheckpointError(f"{fqn} is not in the checkpoint {ckpt_dir}")
    shape = tuple(entry["shape"])
    want = [s.indices(n)[:2] for s, n in zip(index, shape)] if index else [(0, n) for n in shape]
    size = [hi - lo for lo, hi in want]
    d = entry["tp_dim"]
    replicas = check_replicas and bool(copied_heads(layout_from_json(entry.get("layout"))))
    handles = handles if handles is not None else {}
    with ExitStack() as stack:
        opened: dict = {}  # files this call opened: closed (mappings released) on return

        def open_file(name: str):
            f = handles.get(name) or opened.get(name)
            if f is None:
                f = opened[name] = stack.enter_context(_open(Path(ckpt_dir) / name))
            return f

        def read(piece, src):
            return read_region(piece, src, open_file, ckpt_dir, entry["dtype"])

        parts = []
        for (full_lo, length), copies in _runs(fqn, entry):
            src, dst = _overlap(d, full_lo, length, copies[0][1], shape, want)
            if src is None:
                continue
            part = read(copies[0][0], src)
            parts.append((dst, part))
            for piece, p_lo in (copies[1:] if replicas else ()):
                other = read(piece, _overlap(d, full_lo, length, p_lo, shape, want)[0])
                if not torch.equal(other.view(torch.uint8), part.contiguous().view(torch.uint8)):
                    raise CheckpointError(
                        f"replicas of {fqn} differ: rows [{full_lo}, {full_lo + length}) along "
                        f"dim {d} in {Path(ckpt_dir) / piece_files(copies[0][0])[0]} and "
                        f"{Path(ckpt_dir) / piece_files(piece)[0]}; the replicated kv heads must be "
                        "identical (was the checkpoint edited, or trained without syncing them?)")
        if len(parts) == 1 and list(parts[0][1].shape) == size:
            return parts[0][1]  # one run covers the region: no second copy
        out = torch.empty(size, dtype=getattr(torch, entry["dtype"]))
        for dst, part in parts:
            out[dst] = part
        return out


def load_full(ckpt_dir, verify: bool = True, optim: bool = False) -> dict[str, torch.Tensor]:
    """Every logical model tensor at full shape, canonical fqn -> tensor (aliases not repeated;
    see ``read_manifest(ckpt_dir)["aliases"]``); with ``optim`` the optimizer state tensors
    (``optim.<fqn>.<state>``) instead.

    Raises:
        CheckpointError: as :func:`verify_file` (with ``verify``) and :func:`load_tensor`.
    """
    manifest = read_manifest(ckpt_dir)
    if verify:
        for name in sorted(manifest["files"]):
            verify_file(ckpt_dir, name, manifest)
    with ExitStack() as stack:
        handles: dict = {}
        for name in manifest["files"]:
            handles[name] = stack.enter_context(_open(Path(ckpt_dir) / name))
        return {fqn: load_tensor(ckpt_dir, fqn, manifest=manifest, handles=handles)
                for fqn in sorted(manifest["tensors"]) if fqn.startswith(OPTIM_PREFIX) == optim}


def _runs(fqn: str, entry: dict) -> list:
    """``[((full_offset, length), [(piece, piece_offset), ...]), ...]``: the runs of the tp
    dim in order, each with every stored copy (first file first); checked to tile the dim.
    A replicated tensor is one run ``(0, 0)`` whose copies are its pieces."""
    pieces = sorted(entry["pieces"], key=lambda pc: piece_files(pc)[0])
    if not pieces:
        raise CheckpointError(f"{fqn} has no pieces in the manifest")
    d = entry["tp_dim"]
    if d is None:
        return [((0, 0), [(pc, 0) for pc in pieces])]
    runs: dict = {}
    for pc in pieces:
        for full_lo, p_lo, length in pc["segments"]:
            runs.setdefault((full_lo, length), []).append((pc, p_lo))
    end = 0
    for full_lo, length in sorted(runs):
        if full_lo != end:
            raise CheckpointError(f"pieces of {fqn} in the manifest do not tile dim {d} "
                                  f"(gap or overlap at offset {full_lo}, expected {end})")
        end += length
    if end != entry["shape"][d]:
        raise CheckpointError(f"pieces of {fqn} cover {end} of {entry['shape'][d]} along dim {d}")
    return sorted(runs.items())


def _overlap(d, full_lo: int, length: int, p_lo: int, shape: tuple, want: list) -> tuple:
    """``(index into the piece, index into the result)`` of the overlap of one run (full
    ``[full_lo, full_lo + length)`` stored at piece ``[p_lo, ...)`` along ``d``) and the
    requested region ``want`` ((lo, hi) per dim), or ``(None, None)`` when disjoint."""
    src, dst = [], []
    for dim, (lo, hi) in enumerate(want):
        if dim == d:
            r_lo, r_hi, shift = full_lo, full_lo + length, full_lo - p_lo
        else:
            r_lo, r_hi, shift = 0, shape[dim], 0
        a, b = max(lo, r_lo), min(hi, r_hi)
        if a >= b and hi > lo:
            return None, None
        src.append(slice(a - shift, max(a, b) - shift))
        dst.append(slice(a - lo, max(a, b) - lo))
    return tuple(src), tuple(dst)


def _open(path: Path):
    """``safe_open`` with errors turned into CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError for a corrupt header
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
