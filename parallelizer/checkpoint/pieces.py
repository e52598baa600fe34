"""Reading one manifest *piece* (the local tensor of one (stage, tp) coordinate), whole or
in one file (``"file"``) or split by rows into per-rank chunks (``"chunks"``: each data
parallel rank's FSDP shard, written by that rank; writer docstring and
:mod:`parallelizer.runtime.sharded_save`)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import _TYPES as _ST_DTYPES

from parallelizer.checkpoint.format import from_stored, stored_dtype, stored_shape
from parallelizer.errors import CheckpointError

MANIFEST = "manifest.json"
_STAGE = re.compile(r"^pp(\d+)-tp\d+")


def piece_files(piece: dict) -> list[str]:
    """The file names a piece is stored in (one, or one per chunk)."""
    return [piece["file"]] if piece.get("chunks") is None else [c["file"] for c in piece["chunks"]]


def piece_stage(piece: dict) -> Optional[int]:
    """The pipeline stage a piece belongs to (``stage``, else from a ``pp{s}-tp{t}`` name)."""
    if piece.get("stage") is not None:
        return piece["stage"]
    m = _STAGE.match(piece_files(piece)[0])
    return int(m.group(1)) if m else None


def check_header(f, name: str, shape: list, path: Path, dtype: Optional[str] = None) -> None:
    """The file's header agrees with the manifest on tensor ``name``'s shape and ``dtype``
    (a header dtype of the same size would otherwise be cast silently); a complex tensor is
    stored as its real view (:func:`parallelizer.checkpoint.format.stored_shape`).

    Raises:
        CheckpointError: the tensor is absent, or of another shape or dtype; names the file.
    """
    try:
        sl = f.get_slice(name)
        stored, stored_name = list(sl.get_shape()), sl.get_dtype()
    except Exception as e:  # SafetensorError: the name is absent from the header
        raise CheckpointError(f"{path} lacks tensor {name} that {MANIFEST} lists in it ({e}); "
                              "copy the folder again or rewrite it") from None
    want = getattr(torch, dtype) if dtype is not None else None
    if want is not None:
        shape = stored_shape(shape, want)
    if stored != list(shape):
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(stored)}, {MANIFEST} says "
                              f"{tuple(shape)}; the file does not belong to this checkpoint (copy "
                              "the folder again or rewrite it)")
    if want is not None and _ST_DTYPES.get(stored_name) != stored_dtype(want):
        raise CheckpointError(f"{path}: tensor {name} is stored as {stored_name}, {MANIFEST} says "
                              f"{dtype}; the file does not belong to this checkpoint (copy the "
                              "folder again or rewrite it)")


def read_region(piece: dict, src: tuple, open_file: Callable[[str], object], ckpt_dir,
                dtype: str) -> torch.Tensor:
    """Region ``src`` (one slice per dim, step 1; ``()`` for a 0-d piece) of ``piece``;
    ``open_file(name)`` gives an open ``safe_open`` handle of a file of the checkpoint.

    Raises:
        CheckpointError: a header disagrees with the manifest, or the data is unreadable.
    """
    shape = list(piece["shape"])
    if piece.get("chunks") is None:
        return _read(open_file, piece["file"], piece["name"], shape, src, ckpt_dir, dtype)
    if not shape:
        return _read(open_file, piece["chunks"][0]["file"], piece["name"], shape, (), ckpt_dir, dtype)
    lo, hi = src[0].start, src[0].stop
    parts = []
    for c in piece["chunks"]:
        c_lo, c_hi = c["rows"]
        a, b = max(lo, c_lo), min(hi, c_hi)
        if a < b:
            region = (slice(a - c_lo, b - c_lo),) + tuple(src[1:])
            parts.append(_read(open_file, c["file"], piece["name"], [c_hi - c_lo] + shape[1:],
                               region, ckpt_dir, dtype))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.empty([0] + [s.stop - s.start for s in src[1:]], dtype=getattr(torch, dtype))
    return torch.cat(parts)


def _read(open_file, file: str, name: str, shape: list, src: tuple, ckpt_dir, dtype: str):
    path = Path(ckpt_dir) / file
    f = open_file(file)
    check_header(f, name, shape, path, dtype)
    want = getattr(torch, dtype)
    try:
        if want.is_complex:  # stored as its real view: the (re, im) dim read whole
            return from_stored(f.get_slice(name)[tuple(src) + (slice(None),)], want)
        return f.get_slice(name)[src] if shape else f.get_tensor(name)
    except Exception as e:  # SafetensorError: data unreadable
        raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from e
