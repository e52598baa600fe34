"""Vocab-parallel embedding and LM-head operators (Shoeybi et al. 2019, §3,
"input and output embedding"; Megatron-LM's ``VocabParallelEmbedding``,
``gather_from_tensor_model_parallel_region``).

Tp rank ``r`` holds rows ``[r * n, (r + 1) * n)`` of the (padded) vocabulary, ``n`` its local
row count: the layout ``padded`` of :mod:`parallelizer.plan.layouts` (the even split when tp divides
the vocabulary), so the vocabulary offset is ``tp_rank * n`` and needs no other data.

- :func:`vocab_parallel_lookup`: looks up the ids in this rank's range (others give zero
  rows); the graph sums the partial rows over tp with ``g`` after it.
- :func:`gather_from_tp_region`: all-gathers logits sharded along their last dim (the head's
  output, ``Shard(-1)``) and strips the padding columns; backward keeps this rank's slice.

The losses over these logits are in :mod:`parallelizer.runtime.vocab_loss`.

With no tp group set (tp = 1, or the estimator's FakeTensor run) every operator is the
identity on its local tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .tp import tp_group, transport


def tp_coords() -> tuple[int, int]:
    """(tp size, this rank's tp rank); (1, 0) with no tp group set (and no stand-in
    transport: runtime/tp.py ``using_transport``)."""
    stand_in = transport()
    if stand_in is not None:
        return stand_in.size(), stand_in.rank()
    group = tp_group()
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def vocab_parallel_lookup(weight: torch.Tensor, ids: torch.Tensor,
                          padding_idx: int = -1) -> torch.Tensor:
    """``aten.embedding`` over this rank's vocabulary rows: the Partial embedding, which the
    graph then sums over tp with Megatron's ``g`` (an all-reduce, or under sequence
    parallelism a reduce-scatter along the sequence: Korthikanti et al. 2022, §4.2.2).

    Args:
        weight: ``(n, H)``, this rank's rows ``[tp_rank * n, (tp_rank + 1) * n)``.
        ids: int64, any shape, values in ``[0, vocabulary)``.
        padding_idx: global id whose row gets no gradient (``nn.Embedding``), -1 for none.

    Returns:
        ``ids.shape + (H,)``: this rank's rows for the ids in its range, zero rows elsewhere
        (the full embedding at tp = 1).
    """
    size, rank = tp_coords()
    if size == 1:
        return torch.ops.aten.embedding.default(weight, ids, padding_idx)
    return local_lookup(weight, ids, padding_idx, rank)


def local_lookup(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                 tp_rank: int) -> torch.Tensor:
    """Tp rank ``tp_rank``'s partial embedding ``ids.shape + (H,)``: its rows of ``weight``
    (``(n, H)``, global rows ``[tp_rank * n, (tp_rank + 1) * n)``) for the ids in that range,
    zero rows (and zero gradient) for the others."""
    n = weight.shape[0]
    lo = tp_rank * n
    outside = (ids < lo) | (ids >= lo + n)
    local = (ids - lo).masked_fill(outside, 0)
    pad = padding_idx - lo if lo <= padding_idx < lo + n else -1
    rows = torch.ops.aten.embedding.default(weight, local, pad)
    # the masked positions read row 0: zero their output (and so their gradient)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def _all_gather(x: torch.Tensor) -> list:
    if transport() is not None:
        return transport().all_gather(x)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group()))]
    dist.all_gather(parts, x, group=tp_group())
    return parts


class GatherLastDim(torch.autograd.Function):
    """``apply(x, vocab, tp_rank, all_gather)``: the tp ranks' ``(..., n)`` pieces of ``x``
    (``all_gather(x) -> [piece of rank 0, ...]``) concatenated along the last dim, cut to
    ``vocab``; backward: rank ``tp_rank``'s columns of the gradient, zero on padding."""

    @staticmethod
    def forward(ctx, x, vocab, tp_rank, all_gather):
        ctx.rank, ctx.width = tp_rank, x.shape[-1]
        full = torch.cat(all_gather(x.contiguous()), dim=-1)
        # no narrow without padding: the output must not be a view (the model may modify
        # the logits in place; autograd forbids it on a custom Function's view)
        return full if full.shape[-1] == vocab else full.narrow(-1, 0, vocab).contiguous()

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.rank * ctx.width
        mine = grad.narrow(-1, min(lo, grad.shape[-1]), max(0, min(ctx.width, grad.shape[-1] - lo)))
        if mine.shape[-1] < ctx.width:  # padding columns: no gradient
            pad = grad.new_zeros(*grad.shape[:-1], ctx.width - mine.shape[-1])
            mine = torch.cat([mine, pad], dim=-1)
        return mine.contiguous(), None, None, None


def gather_from_tp_region(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits ``(..., n)`` sharded over tp (this rank's vocabulary columns) -> ``(..., vocab)``
    whole on every rank, padding columns dropped. Backward: this rank's columns of the
    gradient (Megatron ``gather_from_tensor_model_parallel_region``)."""
    size, rank = tp_coords()
    if size == 1:
        return x
    return GatherLastDim.apply(x, vocab, rank, _all_gather)
