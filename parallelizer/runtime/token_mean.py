"""Whole-batch denominators of token means (planning/token_mean.py): a loss averaged over its
non-ignored targets, or a sum divided by a count of the inputs, divided by the whole step's
count rather than each chunk's.

The step (runtime/step.py) cuts its batch into ``C`` chunks (dp ranks x microbatches x
gradient accumulation) and averages their losses; chunk ``c`` returning
``numerator_c / (N / C)``, with ``N`` the count over every chunk, makes that average
``sum_c numerator_c / N``: the unmodified model's loss on the whole batch (and its gradient).
Hugging Face's ``num_items_in_batch`` and torchtitan's global-token normalisation are the
same fix. Outside a step (the compile's checks, a forward of its own) each chunk divides by
its own count: the model's own mean.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

# per site: the whole step's count / the number of chunks (a 0-dim fp32 tensor), or None
_DENOMINATORS: list | None = None


def global_mean(numerator: torch.Tensor, count: torch.Tensor, site: int) -> torch.Tensor:
    """``numerator / count`` (0-dim; ``count`` this chunk's), or over the whole step's count
    per chunk while :func:`whole_step_counts` holds one for ``site``."""
    if _DENOMINATORS is None:
        return numerator / count
    return numerator / _DENOMINATORS[site].to(numerator.device)


@contextmanager
def whole_step_counts(denominators: list):
    """Divide by ``denominators`` (one 0-dim tensor per site) within the block."""
    global _DENOMINATORS
    old, _DENOMINATORS = _DENOMINATORS, denominators
    try:
        yield
    finally:
        _DENOMINATORS = old


def counter(source: str):
    """The counting function of ``source`` (``plan.token_means["counter"]``): called with the
    model inputs in the plan's order, it returns each site's count on those rows."""
    scope = {"torch": torch, "device": torch.device, "inf": math.inf, "nan": math.nan,
             "NoneType": type(None), "fx_pytree": fx_pytree, "pytree": pytree}
    exec(compile(source, "<parallelizer token-mean counter>", "exec"), scope)
    forward = scope["forward"]
    return lambda *inputs: forward(None, *inputs)


def denominators(count, chunks: list, chunk_count: int, device, group=None) -> list[torch.Tensor]:
    """Per site, the whole step's count over ``chunk_count`` chunks divided by
    ``chunk_count`` (0-dim fp32 on ``device``): ``count`` on each of this rank's ``chunks``
    (lists of input tensors) summed, then summed over ``group`` (the dp ranks, each with its
    own rows). Collective over ``group``."""
    # a count the model's code moves to a fixed device (the captured .to(device=...)) joins the rest
    per = [torch.stack([torch.as_tensor(c).to(device).double().reshape(()) for c in count(*chunk)])
           for chunk in chunks]
    total = torch.stack(per).sum(0)
    if group is not None:
        dist.all_reduce(total, group=group)
    return [(t / chunk_count).float() for t in total.unbind()]
