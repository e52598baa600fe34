"""Megatron-LM tensor-parallel operators (Shoeybi et al. 2019, §3, Fig. 3).

``f`` = copy_to_tp_region: identity in forward, all-reduce of the gradient in backward;
placed before column_parallel linears, whose replicated input feeds every rank.
``g`` = reduce_from_tp_region: all-reduce in forward, identity in backward; placed after
row_parallel linears, whose outputs are Partial sums.
``scatter_to_tp_region``: each rank keeps its block of a replicated value along a dim
(Megatron's scatter-to-model-parallel-region; all-gather of the gradient in backward);
placed after a per-head value that must meet the rank's heads (BLOOM's ALiBi slopes), and
where a replicated value re-enters sharded compute (a redistribution).
``scatter_copies_to_tp_region``: the same for fewer entries than tp ranks (GQA kv heads
computed whole, met by sharded query heads): each rank keeps the copy its query heads read.
``scatter_pieces_to_tp_region``: the same under a column linear's layout (a bias computed in
forward for a fused q|k|v: the rank's block of each part).
``gather_from_tp_dim``: the whole value of one sharded along a dim (Megatron's
gather-from-model-parallel-region; backward keeps the rank's slice), before an op with no
sharded rule. ``reduce_partial_from_tp``: the all-reduce (sum or average) of an op's Partial
output (a mean over a sharded dim). Both are DTensor's redistributions
(``Shard -> Replicate``, ``Partial -> Replicate``), placed by the planner.

The tp process group is set once per process by the emitted program (``set_tp_group``), so
the generated stage source reads like the paper: ``reduce_from_tp_region(linear(x, w))``.
The compiler's check of its own output runs the same operators on FakeTensors with a
:class:`ShapeTransport` instead of the process group (``using_transport``): every
collective gives the shape it would, so the autograd Functions run as on a cluster.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_TP_GROUP = None
_TRANSPORT = None  # None: the process group; else a ShapeTransport (using_transport)


class ShapeTransport:
    """Tp rank ``rank`` of ``tp`` without communicating: an all-reduce leaves its tensor as
    it is, an all-gather gives ``tp`` copies (shape-faithful stand-ins, for FakeTensors)."""

    def __init__(self, tp: int, rank: int = 0):
        self.tp, self._rank = tp, rank

    def size(self) -> int:
        return self.tp

    def rank(self) -> int:
        return self._rank

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> list:
        return [t.clone() for _ in range(self.tp)]


@contextlib.contextmanager
def using_transport(transport):
    """Within the block the tp operators (here, runtime/vocab.py, runtime/vocab_loss.py)
    use ``transport`` instead of the process group."""
    global _TRANSPORT
    before, _TRANSPORT = _TRANSPORT, transport
    try:
        yield
    finally:
        _TRANSPORT = before


def transport():
    """The :class:`ShapeTransport` in use, or None (the process group)."""
    return _TRANSPORT


def set_tp_group(group) -> None:
    """Use ``group`` (a ProcessGroup over the tp mesh dim) for f and g in this process."""
    global _TP_GROUP
    _TP_GROUP = group


def tp_group():
    return _TP_GROUP


def _tp_size() -> int:
    if _TRANSPORT is not None:
        return _TRANSPORT.size()
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def _tp_rank() -> int:
    return _TRANSPORT.rank() if _TRANSPORT is not None else dist.get_rank(_TP_GROUP)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().clone()
    if _TRANSPORT is not None:
        return _TRANSPORT.all_reduce(t)
    dist.all_reduce(t, group=_TP_GROUP)
    return t


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Megatron ``f``: shape unchanged (any shape); all-reduces the gradient over tp."""
    return x if _tp_size() == 1 else _CopyToTPRegion.apply(x)


def reduce_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Megatron ``g``: sums the Partial outputs of a row_parallel linear over tp."""
    return x if _tp_size() == 1 else _ReduceFromTPRegion.apply(x)


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        n = x.shape[dim] // _tp_size()
        return x.narrow(dim, _tp_rank() * n, n).clone()

    @staticmethod
    def backward(ctx, grad):
        if _TRANSPORT is not None:
            return torch.cat(_TRANSPORT.all_gather(grad.contiguous()), dim=ctx.dim), None
        parts = [torch.empty_like(grad) for _ in range(_tp_size())]
        dist.all_gather(parts, grad.contiguous(), group=_TP_GROUP)
        return torch.cat(parts, dim=ctx.dim), None


def scatter_to_tp_region(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This tp rank's block ``[r * n / tp, (r + 1) * n / tp)`` of ``x`` along ``dim`` (size
    ``n``, divisible by tp): Replicate -> Shard(dim), no communication in forward."""
    return x if _tp_size() == 1 else _ScatterToTPRegion.apply(x, dim)


class _ScatterCopies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim, ctx.n = dim, x.shape[dim]
        return x.narrow(dim, _tp_rank() // (_tp_size() // ctx.n), 1).clone()

    @staticmethod
    def backward(ctx, grad):
        parts = _all_gather_list(grad)  # in rank order: the copies of one entry are adjacent
        copies = len(parts) // ctx.n
        whole = [torch.stack(parts[h * copies:(h + 1) * copies]).sum(0) for h in range(ctx.n)]
        return torch.cat(whole, dim=ctx.dim), None


def scatter_copies_to_tp_region(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This tp rank's copy of entry ``r // (tp / n)`` of the ``n`` entries of ``x`` along
    ``dim`` (tp a multiple of ``n``; GQA kv heads when tp exceeds them, Megatron-LM's
    ``num_query_groups`` < tp): Replicate -> copied heads, no communication in forward.
    Backward: the gradient all-gathered over tp and each entry's copies summed (every rank
    holding a copy contributed its query heads' share)."""
    return x if _tp_size() == 1 else _ScatterCopies.apply(x, dim)


class _ScatterPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, runs):
        ctx.dim, ctx.runs, ctx.shape = dim, runs, x.shape
        return torch.cat([x.narrow(dim, at, n) for at, n in runs[_tp_rank()]], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        whole = grad.new_zeros(ctx.shape)
        for piece, runs in zip(_all_gather_list(grad), ctx.runs):
            at_piece = 0
            for at, n in runs:  # a range held by several ranks (copied heads) sums their shares
                whole.narrow(ctx.dim, at, n).add_(piece.narrow(ctx.dim, at_piece, n))
                at_piece += n
        return whole, None, None


def scatter_pieces_to_tp_region(x: torch.Tensor, dim: int, runs: tuple) -> torch.Tensor:
    """This tp rank's piece of ``x`` along ``dim`` under a column linear's layout (a fused
    q|k|v: the rank's block of each part, or its copy of a kv head): the ranges ``runs[r]``
    (``(full_offset, length)``, plan/layouts.py segments) side by side. Replicate -> Shard
    under that layout, no communication in forward; backward all-gathers the gradient and
    adds each rank's piece into its ranges (copies of one range sum their shares)."""
    return x if _tp_size() == 1 else _ScatterPieces.apply(x, dim, runs)


def _all_gather_cat(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(_all_gather_list(x), dim=dim)


class _GatherFromTPDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, inner):
        ctx.dim, ctx.n, ctx.inner = dim, x.shape[dim], inner
        if not inner:
            return _all_gather_cat(x, dim)
        tp = _tp_size()
        parts = _all_gather_list(_split_merged(x, dim, inner // tp))
        return torch.cat(parts, dim=dim + 1).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.inner:
            return grad.narrow(ctx.dim, _tp_rank() * ctx.n, ctx.n).contiguous(), None, None
        block = ctx.inner // _tp_size()
        mine = _split_merged(grad, ctx.dim, ctx.inner).narrow(ctx.dim + 1, _tp_rank() * block,
                                                               block)
        return mine.flatten(ctx.dim, ctx.dim + 1).contiguous(), None, None


def _split_merged(x: torch.Tensor, dim: int, inner: int) -> torch.Tensor:
    """``x`` with its merged dim ``dim`` (``outer * inner``) split into (outer, inner)."""
    return x.unflatten(dim, (x.shape[dim] // inner, inner))


def _all_gather_list(x: torch.Tensor) -> list:
    x = x.contiguous()
    if _TRANSPORT is not None:
        return _TRANSPORT.all_gather(x)
    parts = [torch.empty_like(x) for _ in range(_tp_size())]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return parts


def gather_from_tp_dim(x: torch.Tensor, dim: int, inner: int = 0) -> torch.Tensor:
    """The tp ranks' blocks of ``x`` along ``dim`` put together: Shard(dim) -> Replicate,
    ``x.shape[dim] * tp`` long (a new tensor, never a view). ``inner`` > 0: ``dim`` merges
    (outer, inner) with the inner factor sharded (DTensor's ``_StridedShard``: BLOOM's
    ``batch * heads``, a ``repeat`` of sharded heads), ``inner`` its global size; each rank's
    piece is ``outer * (inner / tp)`` and the blocks interleave along the inner factor.
    Backward: this rank's block of the gradient."""
    return x if _tp_size() == 1 else _GatherFromTPDim.apply(x, dim, inner)


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, average):
        ctx.average = average
        out = _all_reduce(x)
        return out / _tp_size() if average else out

    @staticmethod
    def backward(ctx, grad):
        return (grad / _tp_size() if ctx.average else grad), None


def reduce_partial_from_tp(x: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Partial -> Replicate: the sum ("sum") or the mean ("avg") over the tp ranks of their
    ``x`` (any shape; a mean over a sharded dim is the average of the ranks' means).
    Backward: the gradient as it is ("sum", as Megatron's g), or divided by tp ("avg")."""
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_partial_from_tp: reduce_op {reduce_op!r} is not 'sum' or 'avg'")
    return x if _tp_size() == 1 else _ReducePartial.apply(x, reduce_op == "avg")
