"""Read checkpoints written by :mod:`parallelizer.checkpoint.writer` (layout in its docstring).

- :func:`load_shard`: the file of one (stage, tp) coordinate, what a rank loads for each
  pipeline stage it runs (dp replicas share it), checked against the manifest's sha256 and the plan hash.
- :func:`load_tensor`: any region of one logical tensor, read lazily with
  ``safe_open(...).get_slice`` from only the pieces that overlap it, so resharding needs memory
  for the requested region only (DESIGN.md §4).
- :func:`load_full`: every logical tensor reassembled, for tests and for export.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from parallelizer.checkpoint.writer import FORMAT_VERSION, MANIFEST, sha256_file, shard_file_name
from parallelizer.errors import CheckpointError
from parallelizer.plan import ParallelPlan


def read_manifest(ckpt_dir) -> dict:
    """The parsed ``manifest.json`` of ``ckpt_dir`` (schema in the writer's docstring).

    Raises:
        CheckpointError: the folder or its manifest is missing, not JSON, or of another
            ``format_version``.
    """
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; {ckpt_dir} is not a parallelizer checkpoint "
                              "(write one with write_checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {version!r}; this parallelizer reads "
                              f"version {FORMAT_VERSION}")
    return manifest


def verify_file(ckpt_dir, file_name: str, manifest: dict) -> Path:
    """Path of ``file_name`` after checking it exists and its sha256 matches the manifest.

    Raises:
        CheckpointError: the file is missing, not listed, or its sha256 differs (names both).
    """
    path = Path(ckpt_dir) / file_name
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (listed in {MANIFEST}); "
                              "copy the complete checkpoint folder or rewrite it")
    expected = manifest["files"].get(file_name)
    if expected is None:
        raise CheckpointError(f"checkpoint file {path} is not listed in {MANIFEST}")
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt: sha256 {actual} does not match "
                              f"{expected} recorded in {MANIFEST}; copy it again or rewrite the "
                              "checkpoint")
    return path


def load_shard(ckpt_dir, stage: int, tp_rank: int, plan: Optional[ParallelPlan] = None,
               verify: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of the (stage, tp_rank) file: canonical fqn -> local piece.

    Every data-parallel replica at that coordinate loads the same file. A piece has the
    plan's ``local_shape(tp)`` for tensors held by pipeline stage ``stage``.

    Args:
        ckpt_dir: checkpoint folder.
        stage, tp_rank: coordinates in ``[0, num_stages)`` x ``[0, tp)`` of the manifest
            (``num_stages`` = pp x virtual stages; pp when the manifest predates it).
        plan: when given, its ``hash()`` must equal the manifest's ``plan_hash``.
        verify: check the file's sha256 against the manifest (reads the file twice).

    Raises:
        CheckpointError: the checkpoint was written for another plan; coordinates out of the
            mesh; the file is missing, corrupt, unreadable, or holds other names than the
            manifest says.
    """
    manifest = read_manifest(ckpt_dir)
    if plan is not None and plan.hash() != manifest["plan_hash"]:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written for another plan (plan_hash "
            f"{manifest['plan_hash'][:12]}..., mesh {manifest['mesh']}); this plan has hash "
            f"{plan.hash()[:12]}..., mesh {plan.mesh}; recompile with the mesh the checkpoint was written for, or save it again under this plan")
    mesh = manifest["mesh"]
    num_stages = manifest.get("num_stages", mesh["pp"])
    if not (0 <= stage < num_stages and 0 <= tp_rank < mesh["tp"]):
        raise CheckpointError(f"(stage {stage}, tp {tp_rank}) is outside the checkpoint's "
                              f"{num_stages} stages x mesh {mesh}")
    name = shard_file_name(stage, tp_rank)
    path = verify_file(ckpt_dir, name, manifest) if verify else Path(ckpt_dir) / name
    expected = {pc["name"] for t in manifest["tensors"].values() for pc in t["pieces"]
                if pc["file"] == name}
    with _open(path) as f:
        found = set(f.keys())
        if found != expected:
            raise CheckpointError(
                f"{path} holds {sorted(found - expected)[:5]} not in {MANIFEST} and lacks "
                f"{sorted(expected - found)[:5]}")
        return {k: f.get_tensor(k) for k in sorted(found)}


def load_tensor(ckpt_dir, fqn: str, index: Optional[tuple[slice, ...]] = None,
                manifest: Optional[dict] = None, handles: Optional[dict] = None) -> torch.Tensor:
    """Region ``index`` (one ``slice`` per dim, step 1; None = all) of logical tensor ``fqn``.

    Reads, with ``get_slice``, only the overlap of each needed piece (one copy per offset),
    so memory is the size of the result. ``handles`` (file name -> open ``safe_open``) lets
    a caller reuse open files across calls.

    Returns:
        tensor of the region's shape and the manifest's dtype.

    Raises:
        CheckpointError: ``fqn`` is not in the manifest, or its pieces do not tile the tensor.
    """
    manifest = manifest if manifest is not None else read_manifest(ckpt_dir)
    entry = manifest["tensors"].get(fqn)
    if entry is None:
        raise CheckpointError(f"{fqn} is not in the checkpoint {ckpt_dir}")
    shape = tuple(entry["shape"])
    want = [s.indices(n)[:2] for s, n in zip(index, shape)] if index else [(0, n) for n in shape]
    out = torch.empty([hi - lo for lo, hi in want], dtype=getattr(torch, entry["dtype"]))
    with ExitStack() as stack:
        handles = handles if handles is not None else {}
        for piece in _one_copy(fqn, entry):
            src, dst = _overlap(piece, shape, want)
            if src is None:
                continue
            if piece["file"] not in handles:
                handles[piece["file"]] = stack.enter_context(_open(Path(ckpt_dir) / piece["file"]))
            out[dst] = _read_piece(handles[piece["file"]], piece, src, bool(shape), ckpt_dir)
    return out


def load_full(ckpt_dir, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every logical tensor at full shape, canonical fqn -> tensor (aliases not repeated;
    see ``read_manifest(ckpt_dir)["aliases"]``).

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
                for fqn in sorted(manifest["tensors"])}


def _one_copy(fqn: str, entry: dict) -> list[dict]:
    """The pieces of one copy (first file per offset), checked to tile the sharded dim."""
    by_offset: dict[int, dict] = {}
    for pc in sorted(entry["pieces"], key=lambda pc: (pc["offset"], pc["file"])):
        by_offset.setdefault(pc["offset"], pc)
    pieces = list(by_offset.values())
    if not pieces:
        raise CheckpointError(f"{fqn} has no pieces in the manifest")
    d = pieces[0]["dim"]
    end = 0
    for pc in pieces:
        if pc["dim"] != d or pc["offset"] != end:
            raise CheckpointError(f"pieces of {fqn} in the manifest do not tile dim {d} "
                                  f"(gap or overlap at offset {pc['offset']})")
        end += pc["length"] if d is not None else 0
    if d is not None and end != entry["shape"][d]:
        raise CheckpointError(f"pieces of {fqn} cover {end} of {entry['shape'][d]} along dim {d}")
    return pieces


def _overlap(piece: dict, shape: tuple, want: list) -> tuple:
    """``(index into the piece, index into the result)`` of the overlap of ``piece`` and the
    requested region ``want`` ((lo, hi) per dim), or ``(None, None)`` when they are disjoint."""
    src, dst = [], []
    for dim, (lo, hi) in enumerate(want):
        p_lo, p_hi = (piece["offset"], piece["offset"] + piece["length"]) \
            if dim == piece["dim"] else (0, shape[dim])
        a, b = max(lo, p_lo), min(hi, p_hi)
        if a >= b and hi > lo:
            return None, None
        src.append(slice(a - p_lo, max(a, b) - p_lo))
        dst.append(slice(a - lo, max(a, b) - lo))
    return tuple(src), tuple(dst)


def _read_piece(f, piece: dict, src: tuple, sliced: bool, ckpt_dir) -> torch.Tensor:
    """Region ``src`` of ``piece`` from the open file ``f`` (whole tensor for 0-d ones)."""
    try:
        return f.get_slice(piece["name"])[src] if sliced else f.get_tensor(piece["name"])
    except Exception as e:  # SafetensorError: name absent or data unreadable
        raise CheckpointError(f"cannot read {piece['name']} from {Path(ckpt_dir) / piece['file']}: "
                              f"{e}") from e


def _open(path: Path):
    """``safe_open`` with errors turned into CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError for a corrupt header
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
