"""Measured pipeline bubble (``run.py --profile``).

Each local stage is a :class:`~parallelizer.runtime.pipeline_stage.TimedPipelineStage`: torch's ``PipelineStage`` whose compute
entry points (``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``,
the calls every torch schedule makes for F, B / I and W actions) record their wall-clock
intervals while a timer is attached. For one step on one rank::

    busy   = total time inside those calls (intervals of several local stages merged)
    bubble = 1 - busy / (wall time of the schedule's step)

so waits for activations or gradients from other ranks, and the send/receive overhead,
count as idle, as in the bubble of GPipe (Huang et al. 2019, §2.3) and Megatron-LM
(Narayanan et al. 2021, §2.2). The loss (computed by the schedule between F and B of the
last stage) counts as idle too; it is tiny next to a stage. On CUDA every call is
synchronised so the intervals are device time.

Rank 0 prints one line ``BUBBLE {json}`` per rank with the median over the profiled steps,
next to the theoretical bubble of the schedule (:func:`parallelizer.plan.schedules.bubble`).
"""
from __future__ import annotations

import json
import statistics
import time

from pathlib import Path

import torch.distributed as dist

from ..plan.schedules import bubble
from ..checkpoint.format import load_tensors
from .pipeline_stage import sync_device
from .batching import dp_slice, to_batch
from .step import StepRunner
from .train import batch_source

PROFILE_STEPS = 5  # steps timed by --profile after one warm-up step


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` (seconds); overlapping calls count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def timed_step(runner, batch) -> float:
    """Run ``runner.step(batch)`` with the stages timed; the bubble fraction of this rank."""
    intervals: list = []
    for st in runner.pipeline_stages:
        st.intervals = intervals
    sync_device(runner.ctx.device)
    start = time.perf_counter()
    try:
        runner.step(batch)
        sync_device(runner.ctx.device)
        wall = time.perf_counter() - start
    finally:
        for st in runner.pipeline_stages:
            st.intervals = None
    return max(0.0, 1.0 - busy_time(intervals) / wall) if wall > 0 else 0.0


def profile_bubble(runner, batch, steps: int = PROFILE_STEPS) -> dict:
    """One warm-up step (builds the schedule, infers shapes), then ``steps`` timed steps of
    forward and backward on ``batch`` (gradients are zeroed after, nothing is updated).

    Returns:
        ``{"rank", "pp_rank", "stages", "schedule", "pp", "virtual_stages", "microbatches",
        "measured", "measured_steps", "theoretical"}``; ``measured`` is the median idle
        fraction in [0, 1], ``theoretical`` None for the zero-bubble schedules.
    """
    plan = runner.plan
    runner.step(batch)
    fractions = [timed_step(runner, batch) for _ in range(steps)]
    for p in runner.stage.parameters():
        p.grad = None
    return {"rank": runner.ctx.rank, "pp_rank": runner.ctx.pp_rank,
            "stages": list(runner.stage.indices), "schedule": runner.schedule_name,
            "pp": plan.mesh["pp"], "virtual_stages": plan.virtual_stages,
            "microbatches": plan.microbatches,
            "measured": round(statistics.median(fractions), 4),
            "measured_steps": [round(f, 4) for f in fractions],
            "theoretical": _round(bubble(runner.schedule_name, plan.mesh["pp"], plan.microbatches,
                                         plan.virtual_stages, upper_bound=False))}


def _round(x):
    return None if x is None else round(x, 4)


def report_bubble(plan, stages, ctx, loss_fn, batch) -> None:
    """``run.py --profile``: global rank 0 prints one ``BUBBLE {json}`` line per rank, in
    rank order (pp > 1 only; gathered, so lines of several ranks never interleave).
    ``batch``: this rank's data-parallel share, on its device. Collective."""
    if plan.mesh["pp"] == 1:
        return
    result = profile_bubble(StepRunner(stages, plan, ctx, loss_fn), batch)
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    for r in gathered or ():
        print("BUBBLE " + json.dumps(r, sort_keys=True), flush=True)


def run_profile(out_dir, plan, spec: dict, stages, ctx, loss_fn, model_module) -> None:
    """The ``--profile`` hook of ``run.py``: profile on the reference inputs when OUT has
    them, else on the first training batch."""
    ref = Path(out_dir) / "reference.safetensors"
    if ref.exists():
        tensors = load_tensors(ref)
        batch = to_batch(plan, [tensors[f"input.{n}"] for n in plan.input_names])
    else:
        batch = next(iter(batch_source(plan, model_module, spec)))
    report_bubble(plan, stages, ctx, loss_fn, dp_slice(plan, batch, ctx.dp_rank, ctx.device))
