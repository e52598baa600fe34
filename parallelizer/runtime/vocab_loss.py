"""Losses over vocab_parallel logits (sharded over tp along the vocabulary, the LM head's
``Shard(-1)`` output; :mod:`parallelizer.runtime.vocab`), never gathering them: Megatron-LM's
vocab-parallel cross-entropy (Shoeybi et al. 2019, §3) for an in-graph loss, torch's
``loss_parallel`` on a DTensor for the user's ``loss_fn``.

- :func:`vocab_parallel_cross_entropy`: ``aten.cross_entropy_loss`` on the shards (the loss a
  Hugging Face model computes when called with ``labels=``).
- :func:`sharded_logits` and :class:`VocabOutputs`: the logits a model returns, handed to
  ``loss_fn`` as a DTensor ``Shard(-1)`` under ``loss_parallel``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .loss_parallel_guard import fused_backward_misuse
from .tp import tp_group, transport
from .vocab import gather_from_tp_region, tp_coords


class _WrongFusedBackward(Exception):
    """loss_fn uses log_softmax where loss_parallel's fused backward is wrong."""


def _reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    if transport() is not None:  # the compile-time check's stand-in (runtime/tp.py)
        return transport().all_reduce(t, op)
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
    size, rank = tp_coords()
    if size == 1:
        return torch.ops.aten.cross_entropy_loss.default(flat, target, None, reduction, ignore_index)
    return VocabParallelCrossEntropy.apply(flat, target, vocab, ignore_index, reduction, rank,
                                           _reduce)


def sharded_logits(x: torch.Tensor, vocab: int, mesh):
    """This rank's logit columns ``(..., n)`` as a DTensor of global shape ``(..., vocab)``
    placed ``Shard(-1)`` on the 1-D tp ``mesh`` (padding columns dropped: the last ranks'
    shards are shorter, as ``torch.chunk`` splits). Differentiable: the gradient reaches ``x``.
    Cross-entropy on it under ``torch.distributed.tensor.parallel.loss_parallel`` all-reduces
    only the max, the sum of exponentials and the target logit over tp."""
    from torch.distributed.tensor import DTensor, Shard
    size, rank = tp_coords()
    n = x.shape[-1]
    real = max(0, min(n, vocab - rank * n))
    local = x if real == n else x.narrow(-1, 0, real)
    shape = (*x.shape[:-1], vocab)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(x.dim() - 1)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def replicated_output(t, mesh):
    """A floating-point model output other than the logits, the same on every tp rank, as a
    ``Replicate`` DTensor, so that ``loss_fn`` mixes only DTensors: ``cross_entropy(logits)
    + 0.01 * aux`` added a plain ``aux`` to the DTensor loss, which DTensor takes in the
    forward (a 0-dim tensor) but whose backward then met a DTensor gradient in aux's own
    plain ops ("got mixed torch.Tensor and DTensor"). ``from_local``'s backward hands the
    output its plain gradient. Any other value as it is."""
    from torch.distributed.tensor import DTensor, Replicate
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point():
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return t


class VocabOutputs:
    """The model outputs the last stage returns vocab-sharded (``plan.vocab_outputs``): how
    ``loss_fn`` sees them and how they are returned whole.

    ``loss_fn`` gets them as DTensors ``Shard(-1)`` (:func:`sharded_logits`), the other
    floating-point outputs as ``Replicate`` DTensors (:func:`replicated_output`), and runs,
    with the backward, under torch's ``loss_parallel`` (:meth:`context`), so a cross-entropy
    never materialises the full logits. A ``loss_fn`` that fails on a DTensor (it mixes them with
    plain tensors, or calls an op DTensor has no rule for) gets them gathered from then on,
    with one warning; so does one whose backward loss_parallel would get wrong (a
    log_softmax read other than by cross-entropy: :mod:`.loss_parallel_guard`), found on the
    loss's autograd graph before any backward. Such a failure is the same on every tp rank
    (same code, same ops), so they all switch together. Out-of-memory and distributed errors
    are raised, not taken for a DTensor limitation (they may hit one rank only, whose peers
    would then wait in other collectives). A DTensor loss is returned as its full
    (replicated) value.
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
                views = [sharded_logits(t, self.vocab[i], self.mesh) if i in self.vocab else
                         replicated_output(t, self.mesh) for i, t in enumerate(flat)]
                loss = loss_fn(unflatten(views), target)
                misuse = fused_backward_misuse(loss, views) if loss.requires_grad else None
                if misuse:
                    raise _WrongFusedBackward(misuse)
                if hasattr(loss, "full_tensor"):  # a view of the DTensor's local tensor: the
                    loss = loss.full_tensor().clone()  # zero-bubble schedules detach_() it
                return loss
            except (torch.OutOfMemoryError, dist.DistError):
                raise  # not a DTensor limitation, and may differ between ranks
            except _WrongFusedBackward as e:
                self._fall_back(f"loss_fn's backward under torch's loss_parallel would be wrong: "
                                f"{e}, and loss_parallel computes log_softmax's backward only "
                                f"inside cross_entropy's (an entropy term, a KL)")
            except Exception as e:  # noqa: BLE001 - any failure of user code on a DTensor
                self._fall_back(f"loss_fn failed on the vocab_parallel logits as a DTensor "
                                f"({type(e).__name__}: {str(e)[:200]})")
        return loss_fn(unflatten(self.whole(flat)), target)

    def _fall_back(self, why: str) -> None:
        self.sharded = False
        if tp_coords()[1] == 0:
            print(f"warning: {why}; it gets them gathered over tp from now on", flush=True)

    def whole(self, flat) -> list:
        """``flat`` with the vocab-sharded outputs gathered over tp (padding dropped).
        Collective over tp."""
        return [gather_from_tp_region(t, self.vocab[i]) if i in self.vocab else t
                for i, t in enumerate(flat)]
