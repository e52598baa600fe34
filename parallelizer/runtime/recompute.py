"""What a checkpointed block's recompute must not do again: write the model's buffers.

``torch.utils.checkpoint`` runs a block's forward a second time in backward. A forward that
writes buffers (BatchNorm's running statistics through ``aten.batch_norm`` and its
``num_batches_tracked.add_(1)``, a step counter) then updated them twice per step: after 3
steps ``num_batches_tracked`` read 6 and the running mean had drifted, with ``--verify``
passing (it compares parameters, not buffers; a break test). The emitted program calls
these helpers in place of such writes (passes/recompute_writes.py); the recompute context
(:class:`Recomputing`, beside the RNG streams' in ``stage_builder``) tells them apart.
"""
from __future__ import annotations

import torch

_depth = 0


def recomputing() -> bool:
    """Inside a checkpointed block's recompute."""
    return _depth > 0


class Recomputing:
    """``inner`` (the RNG streams' recompute context) with :func:`recomputing` true inside.
    Re-enterable, as ``inner`` is: a split backward recomputes a block twice."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        global _depth
        self.inner.__enter__()
        _depth += 1

    def __exit__(self, *exc):
        global _depth
        _depth -= 1
        return self.inner.__exit__(*exc)


def batch_norm(x, weight, bias, running_mean, running_var, training: bool, momentum: float,
               eps: float, cudnn_enabled: bool) -> torch.Tensor:
    """``aten.batch_norm``, leaving the running statistics alone in a recompute: it updates
    copies of them (None would save other tensors for backward than the forward did, which
    checkpoint refuses); in training the output uses the batch's statistics only, so it
    equals the forward's."""
    if training and recomputing() and running_mean is not None:
        running_mean, running_var = running_mean.clone(), running_var.clone()
    return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var,
                                             training, momentum, eps, cudnn_enabled)


def write_once(op: str, target: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The in-place op ``op`` (``"add_.Tensor"``, an ``aten`` overload) on buffer ``target``
    in the forward; in a recompute ``target`` as the forward left it."""
    if recomputing():
        return target
    name, overload = op.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)(target, *args, **kwargs)
