"""Loss used when model.py defines no ``loss_fn``."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def default_loss(outputs, batch) -> torch.Tensor:
    """Mean of the squares of the model's first floating-point output (a mean over samples,
    so it splits across microbatches and data-parallel ranks)."""
    flat, _ = tree_flatten(outputs)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.float().pow(2).mean()
    raise ValueError("default loss: the model returned no floating-point tensor; define loss_fn in model.py")
