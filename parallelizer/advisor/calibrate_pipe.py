"""``parallelize calibrate``'s pipeline measurement: the host time torch's pipelining runtime
adds to every compute action (``PipelineStage``'s bookkeeping of a forward or backward chunk,
the receive it waits in and the send it posts), which the step-time model adds to each
stage's forward and backward in the simulation (``step_parts.pipeline``).

All ranks run one ``Schedule1F1B`` step over a ``torch.nn.Linear(16, 16)`` stage each (the
schedule ``run.py`` uses at v = 1), ``2 x world`` microbatches, repeated; its compute is
measured alone. The overhead ``o`` is the one for which :func:`pipeline_sim.simulate` of this
schedule, on stages of (compute + o) with the calibrated send, gives the measured step: the
simulation is linear in ``o``, so two evaluations solve it.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .pipeline_sim import StageTimes, simulate

WIDTH = 16


def measure_pipeline(device, reps: int, send_s: float) -> dict:
    """{action_us}: seconds per compute action (module docstring); ``send_s``: one send's
    calibrated seconds."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    world, rank = dist.get_world_size(), dist.get_rank()
    m = 2 * world
    torch.manual_seed(0)
    module = torch.nn.Linear(WIDTH, WIDTH).to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, target: out.sum())
    x, target = torch.randn(m, WIDTH, device=device), torch.zeros(m, WIDTH, device=device)

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target)
        else:
            schedule.step()
    step()   # the stages exchange their shapes once
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    measured = _slowest(statistics.median(times), device)
    fwd, bwd = _compute(module, x[:1], reps)
    probe = 1e-3
    at = [simulate("1f1b", world, 1, m, [StageTimes(fwd + o, bwd + o, 0.0)] * world, send_s).makespan
          for o in (0.0, probe)]
    o = (measured - at[0]) / ((at[1] - at[0]) / probe)
    return {"action_us": round(max(o, 0.0) * 1e6, 3)}


def _compute(module, x, reps) -> tuple[float, float]:
    """Median seconds of the stage module's forward and backward on one microbatch, alone."""
    x = x.clone().requires_grad_()
    fwd, bwd = [], []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        y = module(x).sum()
        t1 = time.perf_counter()
        y.backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _slowest(seconds: float, device) -> float:
    worst = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())
