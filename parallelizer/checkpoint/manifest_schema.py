"""Validation of a ``manifest.json`` before anything it names is read.

A checkpoint folder may come from anyone (a download, a shared filesystem), so its manifest
is untrusted input. :func:`validate_manifest` checks, before any tensor file is opened:

- the schema (pydantic): every field the readers, ``reshard`` and ``export`` use has the
  type and range they assume (shapes of non-negative ints, a known torch dtype, ``tp_dim``
  inside the shape, segments and chunks inside their piece, layouts of a known kind, parsed
  by :func:`parallelizer.plan.layouts.layout_from_json`, so ``Entry.layout`` is typed);
- every file entry (``files`` keys, each piece's ``file`` and its chunks' files) is a plain
  file name that resolves inside the checkpoint folder: no ``..``, no absolute path, no
  separator, no symlink leading out (a ``files`` entry of ``../outside/secret.safetensors``
  with that file's true size and sha256 was read and copied by ``reshard`` before this
  check existed);
- every file a piece names is listed in ``files`` (so its size and sha256 are checked).

Each failure is a :class:`CheckpointError` naming the manifest, the entry and the fix.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from parallelizer.errors import CheckpointError
from parallelizer.plan.experts import experts_from_json
from parallelizer.plan.layouts import layout_from_json, layout_json, local_length, segments

NonNeg = Annotated[int, Field(ge=0, strict=True)]
Pos = Annotated[int, Field(ge=1, strict=True)]
_FIX = "the manifest was edited or damaged; copy the checkpoint again or rewrite it"


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Chunk(_Model):
    """Rows ``[lo, hi)`` along dim 0 of a piece, stored in ``file`` (a rank's FSDP shard)."""
    file: str
    rows: tuple[NonNeg, NonNeg]


class Piece(_Model):
    file: Optional[str] = None
    chunks: Optional[list[Chunk]] = Field(default=None, min_length=1)
    name: str
    tp_rank: NonNeg
    stage: Optional[NonNeg] = None
    shape: list[NonNeg]
    segments: Optional[list[tuple[NonNeg, NonNeg, Pos]]]


class Entry(_Model):
    shape: list[NonNeg]
    dtype: str
    is_buffer: Annotated[bool, Field(strict=True)]
    role: str = "replicate"
    tp_dim: Optional[NonNeg]
    layout: Any = None  # a plan.layouts class (or None) once validated
    experts: Any = None  # plan.experts.Experts (or None) once validated
    stages: list[NonNeg] = Field(min_length=1)
    kind: Literal["model", "optim"] = "model"
    param: Optional[str] = None
    pieces: list[Piece] = Field(min_length=1)

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, v: Any):
        return layout_from_json(v)  # ValueError: not a layout (the one check, plan.layouts)

    @field_validator("experts")
    @classmethod
    def _known_experts(cls, v: Any):
        return experts_from_json(v)  # ValueError: not an experts layout (plan/experts.py)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if not isinstance(getattr(torch, v, None), torch.dtype):
            raise ValueError(f"unknown dtype {v!r} (expected a torch dtype name such as float32)")
        return v


class FileEntry(_Model):
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: NonNeg


class Mesh(_Model):
    pp: Pos
    dp: Pos
    tp: Pos


class Train(_Model):
    step: NonNeg
    optimizer: str = ""


class Manifest(_Model):
    format_version: Literal[2]
    plan_hash: str = ""
    layout_hash: str
    mesh: Mesh
    num_stages: Optional[Pos] = None
    tensors: dict[str, Entry]
    aliases: dict[str, str] = {}
    structure: Optional[dict[str, Any]] = None
    train: Optional[Train] = None
    files: dict[str, FileEntry]


def validate_manifest(ckpt_dir, manifest: Any, path: Path) -> None:
    """Raise CheckpointError unless ``manifest`` (parsed ``path``) is well formed and every
    file it names resolves inside ``ckpt_dir`` (module docstring). Reads no tensor file."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a JSON object; {_FIX}")
    files = manifest.get("files")
    if isinstance(files, dict):  # paths first: the most important refusal names the entry
        for name in files:
            check_file_entry(ckpt_dir, name, path, "files")
    try:
        m = Manifest.model_validate(manifest)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise CheckpointError(f"{path}: invalid entry {where!r}: {err['msg']} (got "
                              f"{_short(err.get('input'))}); {_FIX}") from None
    stages = m.num_stages or m.mesh.pp
    for fqn, entry in m.tensors.items():
        _check_entry(ckpt_dir, path, fqn, entry, m.files, stages, m.mesh.tp)
        target = m.tensors.get(entry.param) if entry.kind == "optim" else entry
        if target is None or target.kind != "model":
            raise CheckpointError(f"{path}: optimizer state {fqn!r} belongs to parameter "
                                  f"{entry.param!r}, which is not a model tensor of the manifest; {_FIX}")
    for alias, fqn in m.aliases.items():
        if fqn not in m.tensors:
            raise CheckpointError(f"{path}: alias {alias!r} names {fqn!r}, which is not in "
                                  f"'tensors'; {_FIX}")


def _check_entry(ckpt_dir, path: Path, fqn: str, e: Entry, files: dict, stages: int, tp: int) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {fqn!r}: {what}; {_FIX}")

    nd = len(e.shape)
    if e.tp_dim is not None and e.tp_dim >= nd:
        raise bad(f"tp_dim {e.tp_dim} is outside its {nd}-d shape {e.shape}")
    if any(s >= stages for s in e.stages):
        raise bad(f"stages {e.stages} outside the checkpoint's {stages} stages")
    if e.kind == "optim" and not e.param:
        raise bad("an optimizer state entry without 'param'")
    for i, pc in enumerate(e.pieces):
        where = f"tensors.{fqn}.pieces.{i}"
        if (pc.file is None) == (pc.chunks is None):
            raise bad(f"piece {i} needs exactly one of 'file' and 'chunks'")
        names = [pc.file] if pc.file is not None else [c.file for c in pc.chunks]
        for name in names:
            check_file_entry(ckpt_dir, name, path, where)
            if name not in files:
                raise bad(f"piece {i} names file {name!r}, which 'files' does not list")
        if pc.tp_rank >= tp:
            raise bad(f"piece {i} has tp_rank {pc.tp_rank}, mesh tp is {tp}")
        if len(pc.shape) != nd:
            raise bad(f"piece {i} has shape {pc.shape}, not {nd}-d like {e.shape}")
        if e.tp_dim is None:
            if pc.segments is not None or pc.shape != e.shape:
                raise bad(f"replicated, but piece {i} has shape {pc.shape} or segments")
        else:
            _check_segments(bad, i, e, pc, tp)
        if pc.chunks is not None:
            _check_chunks(bad, i, pc)


def _check_segments(bad, i: int, e: Entry, pc: Piece, tp: int) -> None:
    d = e.tp_dim
    if pc.segments is None:
        raise bad(f"sharded on dim {d}, but piece {i} has no segments")
    if any(pc.shape[k] != e.shape[k] for k in range(len(e.shape)) if k != d):
        raise bad(f"piece {i} shape {pc.shape} differs from {e.shape} off the tp dim {d}")
    layout = e.layout
    try:  # the writer's rule: anything else would read the wrong rows without an error
        want = [list(s) for s in segments(e.shape[d], layout, tp, pc.tp_rank) if s.length]
        length = local_length(e.shape[d], layout, tp)
    except ValueError as err:
        raise bad(f"layout {layout_json(layout)} does not fit dim {d} of {e.shape} at tp={tp}: {err}") from None
    if [list(s) for s in pc.segments] != want or pc.shape[d] != length:
        raise bad(f"piece {i} (tp rank {pc.tp_rank}) has segments {pc.segments} and length "
                  f"{pc.shape[d]} along dim {d}; its layout at tp={tp} gives {want} and {length}")


def _check_chunks(bad, i: int, pc: Piece) -> None:
    if not pc.shape:
        if len(pc.chunks) != 1 or tuple(pc.chunks[0].rows) != (0, 0):
            raise bad(f"piece {i} is 0-d; it takes one chunk with rows [0, 0]")
        return
    end = 0
    for c in pc.chunks:
        lo, hi = c.rows
        if lo != end or hi <= lo:
            raise bad(f"piece {i} chunks do not tile dim 0: rows {[lo, hi]} after row {end}")
        end = hi
    if end != pc.shape[0]:
        raise bad(f"piece {i} chunks cover {end} of its {pc.shape[0]} rows")


def check_file_entry(ckpt_dir, name: Any, path: Path, where: str) -> None:
    """``name`` (from entry ``where`` of manifest ``path``) is a plain file name whose real
    path lies inside ``ckpt_dir``.

    Raises:
        CheckpointError: absolute, with ``..`` or a separator, empty, or a symlink that
            resolves outside the folder; names the entry and the folder.
    """
    if not isinstance(name, str) or not name or name in (".", "..") or "\0" in name \
            or "/" in name or "\\" in name or os.path.isabs(name):
        raise CheckpointError(
            f"{path}: file entry {_short(name)} in {where!r} is not a plain file name inside the "
            f"checkpoint folder {ckpt_dir} (absolute paths, '..' and subfolders are refused); "
            f"nothing was read; a checkpoint names only its own files, e.g. pp0-tp0.safetensors")
    folder = Path(ckpt_dir).resolve()
    target = (folder / name).resolve()
    if target.parent != folder:
        raise CheckpointError(
            f"{path}: file entry {name!r} in {where!r} is a symlink resolving to {target}, outside "
            f"the checkpoint folder {folder}; nothing was read; copy the real file into the "
            "folder instead of linking it")


def _short(v: Any, n: int = 300) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."
