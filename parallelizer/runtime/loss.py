"""Loss used when model.py defines no ``loss_fn``."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def model_loss(outputs) -> torch.Tensor | None:
    """The loss the model computed itself: a Hugging Face ``ModelOutput.loss`` (forward called
    with ``labels=``), else the first 0-dim floating-point output; None when there is none."""
    loss = outputs.get("loss") if hasattr(outputs, "get") else None
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    flat, _ = tree_flatten(outputs)
    return next((t for t in flat if isinstance(t, torch.Tensor) and t.dim() == 0
                 and t.is_floating_point()), None)


def default_loss(outputs, batch) -> torch.Tensor:
    """The model's own loss (:func:`model_loss`: ``outputs.loss`` or a 0-dim output, which
    under microbatches and data parallelism is averaged over them, so it must be a mean
    over samples); without one, the mean of the squares of the model's first floating-point
    output (a mean over samples, so it splits across microbatches and data-parallel ranks)."""
    loss = model_loss(outputs)
    if loss is not None:
        return loss
    flat, _ = tree_flatten(outputs)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.float().pow(2).mean()
    raise ValueError("default loss: the model returned no floating-point tensor; define loss_fn in model.py")
