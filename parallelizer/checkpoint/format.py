"""The checkpoint format (version 2): file names, manifest keys, the layout hash and the file
checksum, shared by the writer, the reader, ``reshard`` / ``export`` and the per-rank saves
of ``run.py`` (docs/checkpoints.md).

A checkpoint folder::

    pp0-tp0.safetensors  pp0-tp1.safetensors  ...   one per (stage, tp); dp replicas share them
    manifest.json

``pp{s}`` is the pipeline *stage* index ``s`` in ``[0, num_stages)``, ``num_stages`` = pp x
``pipeline.virtual_stages``; it equals the pp rank when each rank runs one stage, and a rank
running several stages (interleaved, ZB-V schedules) reads one file per stage. Each file
holds, under its canonical fqn, the tp piece of every tensor whose plan ``stages`` include
stage ``s`` (a tensor tied across stages is stored in each of them), and, in a training
checkpoint, the AdamW state of those parameters under ``optim.<fqn>.exp_avg``,
``optim.<fqn>.exp_avg_sq`` and ``optim.<fqn>.step``, in the parameter's layout. The
manifest (format_version 2)::

    {"format_version": 2, "plan_hash": ..., "layout_hash": ..., "mesh": {"pp", "dp", "tp"},
     "num_stages": pp x virtual_stages (pp when absent),
     "tensors": {name: {"shape", "dtype", "is_buffer", "role", "tp_dim", "layout", "stages",
                        "kind": "model" | "optim", "param": fqn (optim only),
                        "pieces": [{"file" | "chunks", "name", "tp_rank", "stage", "shape",
                                    "segments": [[full_offset, piece_offset, length], ...]
                                                | null (replicated)}, ...]}},
     "aliases": {alias fqn: canonical fqn}, "structure": ParallelPlan.structure,
     "train": {"step": int, "optimizer": str} (training checkpoints only),
     "files": {file name: {"sha256": hex, "bytes": int}}}

A piece is stored whole in ``file``, or, in checkpoints that ``run.py --save`` writes from
every rank (runtime/sharded_save.py), as ``"chunks": [{"file", "rows": [lo, hi]}, ...]``:
rows ``[lo, hi)`` along dim 0 of the piece (a dp rank's FSDP shard) in that rank's file
``pp{s}-tp{t}-dp{d}.safetensors``, under the same tensor name; chunks tile dim 0 in order
(a 0-d piece has one chunk with rows ``[0, 0]``). Pieces carry their ``stage``. Every file
name must be a plain name inside the folder (manifest_schema.py checks the whole manifest
before anything is read).

A piece's ``segments`` say which runs of the full tensor's ``tp_dim`` it holds and where:
``full[full_offset : full_offset + length] == piece[piece_offset : ... + length]`` along
``tp_dim`` (:func:`parallelizer.plan.layouts.segments`). Rows of a piece no segment covers are
vocabulary padding (zero). Two pieces with the same ``(full_offset, length)`` run are
copies (other pp stages of a tied weight, replicated kv heads); readers read one and check
replicated heads are identical. ``layout_hash`` covers pp, tp and every model tensor's
shape, dtype, tp_dim, layout and stages (not dp, not the optimizer state): a program loads a
checkpoint whose layout_hash equals its plan's.

A layout (``"layout"``) is the JSON form of a :mod:`parallelizer.plan.layouts` class.

Complex tensors (a rotary table ``freqs_cis = torch.polar(...)``, complex64) are stored as
their real view (``torch.view_as_real``: the same bytes, dtype float32 for complex64 and
float64 for complex128, one trailing dim of 2), because safetensors has no complex128 and
only releases from 0.7 read ``C64``. The file's ``__metadata__["complex"]`` lists the names
so stored (a JSON list); the manifest keeps the complex dtype and shape, and the readers
turn the view back (:func:`from_stored`), bit for bit. A file without complex tensors has no
such key, so its bytes are those of earlier releases.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import torch

from parallelizer.errors import CheckpointError
from parallelizer.plan.layouts import layout_json

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
OPTIM_PREFIX = "optim."
OPTIM_STATES = ("exp_avg", "exp_avg_sq", "step")


def shard_file_name(stage: int, tp_rank: int) -> str:
    """``pp{s}-tp{t}.safetensors``: the file of pipeline stage ``s`` and tp rank ``t``."""
    return f"pp{stage}-tp{tp_rank}.safetensors"


def optim_name(fqn: str, state: str) -> str:
    """``optim.<fqn>.<state>``: the checkpoint name of one optimizer state tensor."""
    return f"{OPTIM_PREFIX}{fqn}.{state}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32`` (the spelling TensorPlan.dtype uses)."""
    return str(dtype).removeprefix("torch.")


# the safetensors format's dtype names (safetensors 0.8); a complex tensor is stored as its
# real view (stored_dtype), every other dtype has no file form (safetensors_dtype refuses it)
SAFETENSORS_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ"}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype name a tensor of ``dtype`` is written under (``F32`` for
    complex64, stored as its real view; ``BF16``; ...), for any torch dtype.

    Raises:
        CheckpointError: ``dtype`` has no safetensors form (quantized ``qint8``, bit-packed
            ``bits8``, sub-byte ``uint3`` / ``int4``, ``float8_e8m0fnu``, ``float4_e2m1fn_x2``):
            names it and the dtypes that have one.
    """
    name = SAFETENSORS_NAMES.get(stored_dtype(dtype))
    if name is None:
        held = ", ".join(dtype_name(d) for d in SAFETENSORS_NAMES)
        raise CheckpointError(f"dtype {dtype_name(dtype)} has no safetensors form (a checkpoint "
                              f"holds {held} and complex tensors)")
    return name


COMPLEX_KEY = "complex"  # __metadata__ key: JSON list of the names stored as real views


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` has in a file: the real dtype of a complex one."""
    return dtype.to_real() if dtype.is_complex else dtype


def stored_shape(shape, dtype: torch.dtype) -> list:
    """The shape a tensor has in a file: a complex one has a trailing dim of 2 (re, im)."""
    return list(shape) + [2] if dtype.is_complex else list(shape)


def to_stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is written: its real view when complex (no copy), else ``t``."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def from_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor read from a file back as ``dtype``: a complex one from its real view."""
    if dtype.is_complex and not t.is_complex():
        return torch.view_as_complex(t.contiguous())
    return t


def complex_metadata(names) -> dict:
    """The ``__metadata__`` entry naming the complex tensors of a file ({} when none)."""
    names = sorted(names)
    return {COMPLEX_KEY: json.dumps(names)} if names else {}


def complex_names(metadata) -> set:
    """The names a file's ``__metadata__`` lists as complex tensors stored as real views."""
    return set(json.loads((metadata or {}).get(COMPLEX_KEY, "[]")))


def decode_file(tensors: dict, metadata) -> dict:
    """The tensors of a whole file with those its metadata lists turned back to complex."""
    listed = complex_names(metadata)
    return {k: torch.view_as_complex(v.contiguous()) if k in listed else v
            for k, v in tensors.items()}


def save_tensors(tensors: dict, path) -> None:
    """``safetensors.torch.save_file`` of whole tensors, complex ones as real views named in
    the metadata (none: the file save_file alone writes)."""
    from safetensors.torch import save_file
    meta = complex_metadata(k for k, v in tensors.items() if v.is_complex())
    save_file({k: to_stored(v).contiguous() if v.is_complex() else v for k, v in tensors.items()},
              str(path), metadata=meta or None)


def load_tensors(path) -> dict:
    """Every tensor of a safetensors file (:func:`save_tensors`), complex ones restored."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return decode_file({k: f.get_tensor(k) for k in f.keys()}, f.metadata())


def sha256_file(path: Path, window: int = 1 << 24) -> str:
    """Hex sha256 of a file, hashed through 16 MiB memory-mapped windows: no read buffer is
    allocated or copied (``f.read`` per chunk costs ~20% of the hash rate on a warm page
    cache) and resident memory stays one window."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, window):
            with mmap.mmap(f.fileno(), min(window, size - offset), access=mmap.ACCESS_READ,
                           offset=offset) as m:
                h.update(m)
    return h.hexdigest()


def layout_hash(num_stages: int, tp: int, tensors: dict) -> str:
    """sha256 of what decides the bytes of each file: the number of pipeline stages (pp x
    virtual stages: files are per stage, so pp=4 and pp=2 with 2 virtual stages under the
    same partition share files), tp and every model tensor's shape, dtype, tp_dim, layout
    and stages (not dp, not optimizer state). At tp = 1 placements
    decide nothing (a checkpoint keeps them to be resharded to tp > 1 later; a program
    compiled for tp = 1 has none), so they are left out."""
    def placement(t):
        return [t.tp_dim, layout_json(t.layout)] if tp > 1 else [None, None]
    # key "pp" kept from format 2's first writers: with one stage per rank, hashes agree
    data = {"pp": num_stages, "tp": tp, "tensors": {
        k: [list(t.shape), t.dtype, *placement(t), list(t.stages), t.is_buffer]
        for k, t in sorted(tensors.items())}}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
