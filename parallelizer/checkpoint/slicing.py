"""Layout math: which slice of a full tensor one tp rank holds.

Megatron-LM's even split (Shoeybi et al. 2019, §3): a tensor placed ``Shard(d)`` over a tp
mesh dim of degree ``tp`` is cut into ``tp`` equal contiguous blocks along ``d``; rank ``r``
holds block ``r``, i.e. ``[r * n / tp, (r + 1) * n / tp)`` with ``n = shape[d]``.
``Replicate`` (``tp_dim is None``) means every rank holds the whole tensor. Layouts other than
the even split (fused q|k|v, replicated kv heads, padded vocab) are described in
:mod:`parallelizer.plan.layouts`; :func:`local_piece` follows them. A non-dividing degree here is a
bug (the planner checks first), caught by an assertion.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallelizer.plan.layouts import segments
from parallelizer.plan.parallel_plan import TensorPlan


def normalize_dim(tp_dim: Optional[int], ndim: int) -> Optional[int]:
    """``tp_dim`` as a non-negative index into a tensor of ``ndim`` dims (None stays None)."""
    if tp_dim is None:
        return None
    assert -ndim <= tp_dim < ndim, f"tp_dim {tp_dim} out of range for a {ndim}-d tensor"
    return tp_dim % ndim


def shard_range(size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``(offset, length)`` of tp rank ``tp_rank``'s block of a dim of ``size`` elements."""
    assert tp >= 1 and 0 <= tp_rank < tp, f"tp_rank {tp_rank} not in [0, {tp})"
    assert size % tp == 0, f"tp degree {tp} does not divide sharded dim size {size}"
    length = size // tp
    return tp_rank * length, length


def shard_slice(shape, tp_dim: Optional[int], tp: int, tp_rank: int) -> tuple[slice, ...]:
    """Index of tp rank ``tp_rank``'s piece of a tensor of full ``shape``.

    Args:
        shape: full shape, e.g. ``(4096, 1024)``.
        tp_dim: sharded dim (negative allowed) or None for a replicated tensor.
        tp: tp degree; must divide ``shape[tp_dim]`` (internal invariant, asserted).
        tp_rank: rank in ``[0, tp)``.

    Returns:
        one slice per dim: ``(slice(1024, 2048), slice(0, 1024))`` for
        ``shape=(4096, 1024), tp_dim=0, tp=4, tp_rank=1``; all-full slices when replicated.
    """
    shape = tuple(shape)
    full = [slice(0, n) for n in shape]
    d = normalize_dim(tp_dim, len(shape))
    if d is None:
        assert 0 <= tp_rank < tp, f"tp_rank {tp_rank} not in [0, {tp})"
        return tuple(full)
    offset, length = shard_range(shape[d], tp, tp_rank)
    full[d] = slice(offset, offset + length)
    return tuple(full)


def local_piece(tensor: torch.Tensor, tensor_plan: TensorPlan, tp: int, tp_rank: int,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Tp rank ``tp_rank``'s piece of ``tensor``, as a contiguous copy owning its storage
    (safetensors refuses views that share memory), cast to ``dtype`` while copied (default:
    ``tensor``'s: one copy of the piece, never of the whole tensor).

    Args:
        tensor: the full tensor, shape ``tensor_plan.shape``.
        tensor_plan: its placement (``tp_dim``) and ``layout`` (:mod:`parallelizer.plan.layouts`).
        tp, tp_rank: tp degree and rank.

    Returns:
        tensor of shape ``tensor_plan.local_shape(tp)`` and ``dtype``; the segments of the
        layout copied in piece order, padding rows zero.
    """
    assert tuple(tensor.shape) == tuple(tensor_plan.shape), (
        f"{tensor_plan.fqn}: tensor shape {tuple(tensor.shape)} != plan shape {tensor_plan.shape}")
    d = normalize_dim(tensor_plan.tp_dim, tensor.dim())
    if d is None:
        return tensor.to(dtype or tensor.dtype, memory_format=torch.contiguous_format, copy=True)
    piece = tensor.new_zeros(tensor_plan.local_shape(tp), dtype=dtype or tensor.dtype)
    for seg in segments(tensor.shape[d], tensor_plan.layout, tp, tp_rank):
        piece.narrow(d, seg.piece_offset, seg.length).copy_(tensor.narrow(d, seg.full_offset, seg.length))
    return piece
