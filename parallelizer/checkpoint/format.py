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
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import torch

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
