"""One tp rank's slice of a tensor (checkpoint/slicing.py).
"""
from __future__ import annotations


import pytest
import torch

from parallelizer.checkpoint import (local_piece, shard_slice)
from parallelizer.plan.parallel_plan import TensorPlan


# ---------------------------------------------------------------- layout


def test_shard_slice():
    assert shard_slice((4096, 1024), 0, 4, 1) == (slice(1024, 2048), slice(0, 1024))
    assert shard_slice((6, 8), -1, 2, 1) == (slice(0, 6), slice(4, 8))
    assert shard_slice((6, 8), None, 4, 3) == (slice(0, 6), slice(0, 8))
    with pytest.raises(AssertionError, match="does not divide"):
        shard_slice((6, 8), 0, 4, 0)


def test_local_piece_is_contiguous_copy():
    t = torch.arange(24.0).reshape(4, 6)
    plan = TensorPlan("w", (4, 6), "float32", 1, (0,))
    piece = local_piece(t, plan, 2, 1)
    assert piece.is_contiguous() and piece.shape == plan.local_shape(2)
    assert torch.equal(piece, t[:, 3:]) and piece.data_ptr() != t.data_ptr()
