"""Write a safetensors file one tensor at a time, hashing as it goes.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a resharder
producing the pieces one by one would then hold a whole (pp, tp) file. The format is simple
enough to stream (https://github.com/huggingface/safetensors#format): 8 bytes little-endian
header length N, N bytes of JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces to a multiple of 8), then the raw
row-major bytes of every tensor at its offsets. Knowing every shape and dtype up front, the
header is written first and each tensor's bytes are appended and hashed as it is produced.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_streamed(path: Path, specs: Sequence[tuple[str, tuple, torch.dtype]],
                   produce: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Write the tensors ``specs`` (name, shape, dtype; in file order) to ``path``, asking
    ``produce(name)`` for each in turn, then fsync.

    Peak memory: one produced tensor. Returns ``(sha256 hex, size in bytes)`` of the file.

    Raises:
        AssertionError: a produced tensor differs from its spec (a bug in the caller).
    """
    header, offset = {}, 0
    for name, shape, dtype in specs:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    # hashing overlaps the write of the same buffer: both release the GIL
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            h.update(chunk)
        for name, shape, dtype in specs:
            t = produce(name)
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (
                f"{name}: produced {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
            data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            hashed = hasher.submit(h.update, data)
            f.write(data)
            hashed.result()
            del t, data
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return h.hexdigest(), size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
