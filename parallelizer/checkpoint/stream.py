"""Write a safetensors file one tensor at a time, hashing as it goes.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a resharder
producing the pieces one by one would then hold a whole (pp, tp) file. The format is simple
enough to stream (https://github.com/huggingface/safetensors#format): 8 bytes little-endian
header length N, N bytes of JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces to a multiple of 8), then the raw
row-major bytes of every tensor at its offsets. Knowing every shape and dtype up front, the
header is written first and each tensor's bytes are appended and hashed as it is produced.
A complex tensor is written as its real view, named in ``__metadata__["complex"]``
(:mod:`parallelizer.checkpoint.format`).

Each tensor goes out in blocks of :data:`CHUNK` bytes, each hashed and then written while it
is still in the CPU cache, straight from the tensor's memory (a lazily mapped input region
is never copied in user space); only a non-contiguous tensor (a column block of a row-major
piece) is gathered, block by block, into one reused buffer.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from parallelizer.errors import CheckpointError
from parallelizer.checkpoint.format import (complex_metadata, safetensors_dtype, stored_shape,
                                            to_stored)

# bit-for-bit copies of any dtype (bfloat16, float8 have no numpy type) as integers
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 1 << 22  # 4 MiB: fits the last-level cache, so write() reads what sha256 just read


def write_streamed(path: Path, specs: Sequence[tuple[str, tuple, torch.dtype]],
                   produce: Callable[[str], torch.Tensor], metadata: dict[str, str],
                   fsync: bool = True) -> tuple[str, int]:
    """Write the tensors ``specs`` (name, shape, dtype; in file order) to ``path``, asking
    ``produce(name)`` for each in turn, then fsync (unless ``fsync`` is False: the caller
    syncs the file before publishing it).

    Peak memory: one produced tensor plus :data:`CHUNK` bytes. Returns ``(sha256 hex, size
    in bytes)`` of the file. Runs in the calling thread (hashlib, os.write and torch copies
    release the GIL, so several files can be written in parallel threads).

    Raises:
        AssertionError: a produced tensor differs from its spec (a bug in the caller, or an
            input that is not what its manifest says).
        CheckpointError: a dtype with no safetensors form (names the tensor).
    """
    header, offset = {}, 0
    for name, shape, dtype in specs:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            st_dtype = safetensors_dtype(dtype)
        except CheckpointError as e:
            raise CheckpointError(f"{name}: {e}") from None
        header[name] = {"dtype": st_dtype,
                        "shape": stored_shape(shape, dtype),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {**metadata, **complex_metadata(
        n for n, _s, dtype in specs if dtype.is_complex)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    scratch: list[torch.Tensor] = []  # the one reused gather buffer, allocated on first need
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        head = struct.pack("<Q", len(raw)) + raw
        h.update(head)
        _write_all(fd, memoryview(head))
        size = len(head)
        for name, shape, dtype in specs:
            t = produce(name)
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (
                f"{name}: produced {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
            for block in _blocks(to_stored(t), scratch):
                h.update(block)
                _write_all(fd, block)
                size += len(block)
            del t
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return h.hexdigest(), size


def _blocks(t: torch.Tensor, scratch: list) -> Iterator[memoryview]:
    """The row-major bytes of ``t`` in blocks of about :data:`CHUNK` bytes: views of its
    memory when contiguous, else rows gathered into ``scratch[0]`` (reused, grown once)."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for i in range(0, len(mv), CHUNK):
            yield mv[i:i + CHUNK]
        return
    row = t[0].numel() * t.element_size()
    rows = max(1, CHUNK // row)  # a row is never split: a single row larger than CHUNK goes whole
    need = min(rows, t.shape[0]) * row
    if not scratch or scratch[0].numel() < need:
        scratch[:] = [torch.empty(need, dtype=torch.uint8)]
    # numpy copies in this thread; torch's copy_ would wake its intra-op pool, whose
    # spinning threads cost more CPU than the copy when every core already runs a writer
    same = _SAME_SIZE_INT[t.element_size()]
    src = t.view(same).numpy()
    for r in range(0, t.shape[0], rows):
        part = src[r:r + rows]
        n = part.size * t.element_size()
        out = scratch[0][:n].view(same).numpy().reshape(part.shape)
        np.copyto(out, part)
        yield memoryview(scratch[0][:n].numpy())


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data):]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
