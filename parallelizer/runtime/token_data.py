"""Token data for ``run.py --train`` (spec ``data:``): a tokenised corpus on disk, cut into
fixed-length windows, read by each data-parallel rank for its own rows only.

Files: ``.bin`` (a flat array of ``data.dtype``, uint16 or uint32, as nanoGPT's
``data/*/prepare.py`` writes with ``np.array(ids, dtype=np.uint16).tofile(...)``) or a 1-D
integer ``.npy``; a folder holds several, read in name order. Both are memory-mapped.

Samples are the non-overlapping windows of ``seq_len`` tokens of each file (a window never
crosses two files; a file's last partial window is dropped). Batch ``k`` of the run (0, 1,
...) is ``batch_size`` windows: in epoch ``e = k // (windows // batch_size)``, the windows of a
``torch.randperm`` seeded with ``seed + e`` (``data.shuffle``; else file order), in slices of
``batch_size``; data-parallel rank ``r`` reads rows ``[r * b / dp, (r + 1) * b / dp)`` of it.
So the position is one number, the batches consumed, saved with the checkpoint and resumed
exactly.
"""
from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

SUFFIXES = (".bin", ".npy")


class DataError(UserError):
    """A token file is missing, unreadable, too short or holds ids outside the vocabulary."""


def token_files(path: str | Path, key: str = "data.path") -> list[Path]:
    """The token files of ``path`` (a file, or a folder's .bin/.npy files in name order).

    Raises:
        DataError: nothing there, another suffix, or a folder without token files.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}: {p} does not exist; pass a .bin or .npy token file (or a folder "
                        f"of them), e.g. written by nanoGPT's prepare.py")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
        if not files:
            raise DataError(f"{key}: the folder {p} holds no .bin or .npy file")
        return files
    if p.suffix not in SUFFIXES:
        raise DataError(f"{key}: {p} is neither a .bin nor a .npy file; convert it to token ids first")
    return [p]


def open_tokens(path: Path, dtype: str, key: str = "data.path") -> np.ndarray:
    """A read-only memory map of one token file (1-D).

    Raises:
        DataError: unreadable, not 1-D integers, or a .bin whose size is not a multiple of
            the dtype's.
    """
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
        else:
            size = path.stat().st_size
            item = np.dtype(dtype).itemsize
            if size % item:
                raise DataError(f"{key}: {path} has {size} bytes, not a multiple of {dtype}'s "
                                f"{item}; set data.dtype to the type it was written with")
            arr = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    except (OSError, ValueError) as e:
        raise DataError(f"{key}: cannot read {path}: {e}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{key}: {path} must be a 1-D array of integer token ids, got "
                        f"{arr.dtype} of shape {arr.shape}")
    return arr


class TokenData:
    """Windows of ``seq_len`` tokens from the files of ``path``, batched as the module
    docstring says.

    Raises:
        DataError: a missing or malformed file, fewer windows than one batch, a negative
            token id or one >= ``vocab_size`` (when given), naming the file and the fix.
    """

    def __init__(self, path, dtype: str, seq_len: int, batch_size: int, seed: int,
                 shuffle: bool = True, vocab_size: int | None = None, key: str = "data.path"):
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.files = token_files(path, key)
        self.arrays = [open_tokens(f, dtype, key) for f in self.files]
        counts = [len(a) // seq_len for a in self.arrays]
        self.starts = list(np.cumsum([0] + counts))  # first window index of each file
        self.windows = int(self.starts[-1])
        if self.windows < batch_size:
            tokens = sum(len(a) for a in self.arrays)
            raise DataError(f"{key}: {_names(self.files)} holds {tokens} tokens = {self.windows} "
                            f"windows of seq_len {seq_len}, fewer than one batch of {batch_size}; "
                            f"use more data, a smaller --batch-size or --seq-len")
        for f, a in zip(self.files, self.arrays):
            _check_ids(f, a, vocab_size, key)
        self.per_epoch = self.windows // batch_size
        self._perm = (None, None)

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm[0] != epoch:
            order = torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.seed + epoch)) \
                if self.shuffle else torch.arange(self.windows)
            self._perm = (epoch, order)
        return self._perm[1]

    def batch_windows(self, position: int) -> torch.Tensor:
        """The window indices of batch ``position`` (0-based, counted over the whole run)."""
        epoch, k = divmod(position, self.per_epoch)
        return self._order(epoch)[k * self.batch_size:(k + 1) * self.batch_size]

    def rows(self, windows) -> torch.Tensor:
        """The token ids of ``windows``, ``[len(windows), seq_len]`` int64."""
        out = np.empty((len(windows), self.seq_len), dtype=np.int64)
        for i, w in enumerate(int(w) for w in windows):
            f = bisect.bisect_right(self.starts, w) - 1
            at = (w - self.starts[f]) * self.seq_len
            out[i] = self.arrays[f][at:at + self.seq_len]
        return torch.from_numpy(out)

    def local_batch(self, position: int, dp_rank: int, dp: int) -> torch.Tensor:
        """This data-parallel rank's rows of batch ``position``."""
        n = self.batch_size // dp
        return self.rows(self.batch_windows(position)[dp_rank * n:(dp_rank + 1) * n])


def _check_ids(path: Path, arr: np.ndarray, vocab_size: int | None, key: str,
               chunk: int = 1 << 24) -> None:
    """Raise DataError at the first negative token id (an embedding would read it as a
    row from the end at tp > 1, where the vocabulary is sharded, and fail at tp 1), or the
    first >= ``vocab_size`` when given (scanned in chunks)."""
    signed = not np.issubdtype(arr.dtype, np.unsignedinteger)
    for at in range(0, len(arr), chunk):
        part = np.asarray(arr[at:at + chunk])
        low = int(part.min()) if len(part) and signed else 0
        if low < 0:
            where = at + int(np.argmax(part < 0))
            raise DataError(f"{key}: {path} holds token id {low} (first negative one at position "
                            f"{where}); token ids are 0 or more: check data.dtype and the file")
        if vocab_size is None:
            continue
        top = int(part.max()) if len(part) else 0
        if top >= vocab_size:
            where = at + int(np.argmax(part >= vocab_size))
            raise DataError(f"{key}: {path} holds token id {top} (first bad one at position "
                            f"{where}) but the model's vocabulary has {vocab_size} ids (0..{vocab_size - 1}); "
                            f"tokenise with the model's tokenizer, or check data.dtype")


def _names(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
