"""Vocab-parallel embedding and LM-head operators (Shoeybi et al. 2019, §3, "input and output
embedding"; Megatron-LM's ``VocabParallelEmbedding`` and ``gather_from_tensor_model_parallel_region``).

Tp rank ``r`` holds rows ``[r * n, (r + 1) * n)`` of the (padded) vocabulary, ``n`` its local
row count: the layout ``padded`` of :mod:`parallelizer.layouts` (the even split when tp divides
the vocabulary), so the vocabulary offset is ``tp_rank * n`` and needs no other data.

- :func:`vocab_parallel_embedding`: looks up the ids in this rank's range (others give zero
  rows), then :func:`reduce_embedding` sums the partial rows over tp.
- :func:`gather_from_tp_region`: all-gathers logits sharded along their last dim (the head's
  output, ``Shard(-1)``) and strips the padding columns; backward keeps this rank's slice.
- :func:`sharded_logits`: the same logits as a DTensor ``Shard(-1)`` over the tp mesh (padding
  columns stripped, uneven shards as ``torch.chunk`` makes them), for ``loss_fn`` under
  torch's ``loss_parallel``.

With no tp group set (tp = 1, or the estimator's FakeTensor run) every operator is the
identity on its local tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .tp import reduce_from_tp_region, tp_group


def _tp() -> tuple[int, int]:
    group = tp_group()
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def reduce_embedding(x: torch.Tensor) -> torch.Tensor:
    """Sum the tp ranks' partial embedding rows (Megatron's all-reduce after the lookup).

    One function so that sequence parallelism (Korthikanti et al. 2022, §4.2.2) can make it a
    reduce-scatter along the sequence instead."""
    return reduce_from_tp_region(x)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor,
                             padding_idx: int = -1) -> torch.Tensor:
    """``aten.embedding`` over this rank's vocabulary rows, summed over tp.

    Args:
        weight: ``(n, H)``, this rank's rows ``[tp_rank * n, (tp_rank + 1) * n)``.
        ids: int64, any shape, values in ``[0, vocabulary)``.
        padding_idx: global id whose row gets no gradient (``nn.Embedding``), -1 for none.

    Returns:
        ``ids.shape + (H,)``: the full embedding, on every tp rank.
    """
    size, rank = _tp()
    if size == 1:
        return torch.ops.aten.embedding.default(weight, ids, padding_idx)
    return reduce_embedding(local_lookup(weight, ids, padding_idx, rank))


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
        return torch.cat(all_gather(x.contiguous()), dim=-1).narrow(-1, 0, vocab).contiguous()

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
    size, rank = _tp()
    if size == 1:
        return x
    return GatherLastDim.apply(x, vocab, rank, _all_gather)


def sharded_logits(x: torch.Tensor, vocab: int, mesh):
    """This rank's logit columns ``(..., n)`` as a DTensor of global shape ``(..., vocab)``
    placed ``Shard(-1)`` on the 1-D tp ``mesh`` (padding columns dropped: the last ranks'
    shards are shorter, as ``torch.chunk`` splits). Differentiable: the gradient reaches ``x``.
    Cross-entropy on it under ``torch.distributed.tensor.parallel.loss_parallel`` all-reduces
    only the max, the sum of exponentials and the target logit over tp."""
    from torch.distributed.tensor import DTensor, Shard
    size, rank = _tp()
    n = x.shape[-1]
    real = max(0, min(n, vocab - rank * n))
    local = x if real == n else x.narrow(-1, 0, real)
    shape = (*x.shape[:-1], vocab)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(x.dim() - 1)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


class VocabOutputs:
    """The model outputs the last stage returns vocab-sharded (``plan.vocab_outputs``): how
    ``loss_fn`` sees them and how they are returned whole.

    ``loss_fn`` gets them as DTensors ``Shard(-1)`` (:func:`sharded_logits`) and runs, with
    the backward, under torch's ``loss_parallel`` (:meth:`context`), so a cross-entropy never
    materialises the full logits. A ``loss_fn`` that fails on a DTensor (it mixes them with
    plain tensors, or calls an op DTensor has no rule for) gets them gathered from then on,
    with one warning. A DTensor loss is returned as its full (replicated) value.
    """

    def __init__(self, plan, mesh):
        self.vocab, self.mesh, self.sharded = dict(plan.vocab_outputs), mesh, True

    def context(self):
        import contextlib
        if not self.vocab or self.mesh is None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()

    def loss(self, loss_fn, flat, unflatten, target) -> torch.Tensor:
        """``loss_fn(unflatten(outputs), target)`` with the vocab-sharded outputs of ``flat``
        as DTensors (or gathered, see the class)."""
        if not self.vocab or self.mesh is None:
            return loss_fn(unflatten(flat), target)
        if self.sharded:
            try:
                views = [sharded_logits(t, self.vocab[i], self.mesh) if i in self.vocab else t
                         for i, t in enumerate(flat)]
                loss = loss_fn(unflatten(views), target)
                return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            except Exception as e:  # noqa: BLE001 - any failure of user code on a DTensor
                self.sharded = False
                if _tp()[1] == 0:
                    print(f"warning: loss_fn failed on the vocab_parallel logits as a DTensor "
                          f"({type(e).__name__}: {str(e)[:200]}); it gets them gathered over tp "
                          f"from now on", flush=True)
        return loss_fn(unflatten(self.whole(flat)), target)

    def whole(self, flat) -> list:
        """``flat`` with the vocab-sharded outputs gathered over tp (padding dropped).
        Collective over tp."""
        return [gather_from_tp_region(t, self.vocab[i]) if i in self.vocab else t
                for i, t in enumerate(flat)]


def _reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                    group=tp_group())
    return t


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``apply(logits, target, vocab, ignore_index, reduction, tp_rank, all_reduce)``:
    cross-entropy of logits sharded along the vocabulary (Megatron-LM's
    ``vocab_parallel_cross_entropy``): ``all_reduce(t, "max" | "sum")`` of the row max, of
    the target logit and of the sum of exponentials, never the logits. ``logits``: ``(N, n)``
    this rank's columns ``[tp_rank * n, ...)`` (columns past ``vocab`` are padding and left
    out of the softmax); ``target``: ``(N,)``."""

    @staticmethod
    def forward(ctx, logits, target, vocab, ignore_index, reduction, tp_rank, all_reduce):
        n = logits.shape[-1]
        lo = tp_rank * n
        x = logits.float()
        if lo + n > vocab:  # padding columns: exp() = 0
            x = x.clone()
            x[:, max(0, vocab - lo):] = float("-inf")
        m = all_reduce(x.max(dim=-1).values.clone(), "max")
        shifted = x - m.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < lo + n)
        t_local = (target - lo).masked_fill(~mine, 0)
        picked = shifted.gather(1, t_local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        picked = all_reduce(picked, "sum")
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), "sum")
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), t_local, mine, valid)
        ctx.reduction, ctx.dtype = _REDUCTIONS[reduction], logits.dtype
        ctx.count = valid.sum()
        if ctx.reduction == "mean":
            return (loss.sum() / ctx.count).to(logits.dtype)
        return (loss.sum() if ctx.reduction == "sum" else loss).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, t_local, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, t_local] -= mine.to(g.dtype)
        per_row = grad.float() / ctx.count if ctx.reduction == "mean" else grad.float()
        g = g * (per_row.unsqueeze(-1) if per_row.dim() else per_row)
        g = g.masked_fill(~valid.unsqueeze(-1), 0.0)
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab: int,
                                 reduction: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """``aten.cross_entropy_loss(logits.reshape(-1, vocab), target)`` for logits sharded over
    tp along the last dim (``(..., n)``, this rank's vocabulary columns), without gathering
    them: Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al. 2019, §3), the one
    torch's ``loss_parallel`` computes on a DTensor. ``reduction``: at::Reduction (0 none,
    1 mean over non-ignored targets, 2 sum). Returns a 0-dim tensor (mean, sum) or ``(N,)``."""
    flat = logits.reshape(-1, logits.shape[-1])
    size, rank = _tp()
    if size == 1:
        return torch.ops.aten.cross_entropy_loss.default(flat, target, None, reduction, ignore_index)
    return VocabParallelCrossEntropy.apply(flat, target, vocab, ignore_index, reduction, rank,
                                           _reduce)
