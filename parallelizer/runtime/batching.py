"""Batches as the emitted program sees them: flat tensors in the plan's input order."""
from __future__ import annotations

import itertools

import torch
from torch.utils._pytree import tree_map

from ..plan.dtypes import differentiable
from ..plan.parallel_plan import ParallelPlan


def to_batch(plan: ParallelPlan, flat: list) -> tuple | dict:
    """Flat tensors -> the structure example_inputs() returns (dict or tuple)."""
    if plan.inputs_are_kwargs:
        return dict(zip(plan.input_names, flat))
    return tuple(flat)


def flatten(plan: ParallelPlan, batch) -> list:
    if isinstance(batch, dict):
        return [batch[n] for n in plan.input_names]
    if isinstance(batch, torch.Tensor):
        return [batch]
    return list(batch)


def index_rows(tree, rows: torch.Tensor):
    """The samples ``rows`` (dim 0) of every tensor in ``tree`` (a batch or a target)."""
    return tree_map(lambda t: t[rows.to(t.device)] if isinstance(t, torch.Tensor) else t, tree)


def dp_slice(plan: ParallelPlan, batch, dp_rank: int, device) -> tuple | dict:
    """This data-parallel rank's contiguous share of the global batch, on ``device``.

    Raises:
        ValueError: the global batch size is not divisible by dp x microbatches.
    """
    flat = flatten(plan, batch)
    b = flat[0].shape[0]
    dp, m = plan.mesh["dp"], plan.microbatches  # at pp = 1 too: the step accumulates them
    if b % (dp * m):
        raise ValueError(f"batch size {b} is not divisible by mesh.dp ({dp}) x "
                         f"pipeline.microbatches ({m}) = {dp * m}; use a batch size that is a "
                         f"multiple of {dp * m}")
    n = b // dp
    # an input without the batch dim (Flux's per-position ids) is whole: the compile refuses
    # it where anything splits (planning/spec_checks.check_batch)
    return to_batch(plan, [(t[dp_rank * n:(dp_rank + 1) * n] if t.shape[0] == b else t).to(device)
                           for t in flat])


def synthetic_batches(plan: ParallelPlan, example, seed: int):
    """Seeded batches shaped like ``example``: token ids in the example's range, floats (and
    complex values) N(0, 1)."""
    flat = flatten(plan, example)
    for step in itertools.count():
        g = torch.Generator().manual_seed(seed + step)
        out = []
        for t in flat:
            if differentiable(t.dtype):
                out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
            else:
                hi = int(t.max()) + 1 if t.numel() else 1
                out.append(torch.randint(0, max(hi, 1), t.shape, generator=g, dtype=t.dtype))
        yield to_batch(plan, out)
