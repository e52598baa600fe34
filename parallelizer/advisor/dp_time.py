"""Data-parallel communication of a step as the runtime schedules it
(``parallelizer/runtime/data_parallel.py``, ``runtime/step.py``), and the optimizer step.

- pp = 1, ZeRO 0/1: DDP (torch's ``replicate``). Gradients are all-reduced in buckets
  (25 MB, the first 1 MB: DDP's defaults), each launched as soon as the backward has
  produced all of its gradients (last unit first), one after the other on one channel; what
  outlasts the backward is exposed. ZeRO-1 (``ZeroRedundancyOptimizer``) then broadcasts
  every parameter from the rank that updated it.
- pp = 1, ZeRO 2/3: FSDP2, one unit per block plus the root (embedding, final norm, head).
  Forward all-gathers unit i+1 while unit i computes (prefetch 1; 0: only when it is
  needed); ZeRO-3 all-gathers each block again in backward; each unit's reduce-scatter
  (HSDP: then an all-reduce over the replicas) follows its backward. One channel, FIFO.
- pp > 1: gradients are reduced after the schedule: ZeRO 0/1 one coalesced all-reduce of
  this rank's gradients (``all_reduce_grads``), ZeRO 2/3 every unit's reduce-scatter
  (torch's ``PipelineStage`` defers FSDP's gradient sync to the last backward), exposed.
  ZeRO-2 gathers the parameters in the first forward, ZeRO-3 in every microbatch's backward
  (FSDP2 keeps them unsharded between a backward and the next forward); both overlap the
  stage's compute as above.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .collectives import Call

DDP_BUCKET = 25e6
DDP_FIRST_BUCKET = 1e6


@dataclass
class DataParallel:
    """Exposed seconds and the calls behind them."""
    exposed: float = 0.0
    calls: list = field(default_factory=list)
    optimizer: float = 0.0


def ddp_exposed(bwd_s: list[float], grad_bytes: list[float], reduce) -> tuple[float, list]:
    """DDP buckets over the backward (``bwd_s``, ``grad_bytes`` per unit in backward order);
    ``reduce(nbytes)`` -> Call. Returns (seconds past the backward's end, calls)."""
    t_comp = t_comm = 0.0
    pending, cap, calls = 0.0, DDP_FIRST_BUCKET, []
    for i, (t, g) in enumerate(zip(bwd_s, grad_bytes)):
        t_comp += t
        pending += g
        if pending >= cap or i == len(bwd_s) - 1:
            if pending > 0:
                c = reduce(pending)
                calls.append(c)
                t_comm = max(t_comm, t_comp) + c.seconds
            pending, cap = 0.0, DDP_BUCKET
    return max(0.0, t_comm - t_comp), calls


def fsdp_exposed(fwd_s: list[float], bwd_s: list[float], gather: list, reduce: list,
                 zero3: bool, prefetch: int) -> tuple[float, float]:
    """One microbatch under FSDP2 at pp = 1. ``fwd_s``/``bwd_s``: compute per unit in forward
    order (the root's parts first and last); ``gather[i]``/``reduce[i]``: seconds of unit i's
    all-gather / reduce-scatter (0 for a unit with nothing to gather). Returns (makespan -
    compute, compute)."""
    n = len(fwd_s)
    t_comp, t_comm = 0.0, gather[0]
    ready = {0: t_comm}
    for u in range(n):
        start = max(t_comp, ready.get(u, 0.0))
        if u + 1 < n:
            issue = start if prefetch else start + fwd_s[u]
            t_comm = max(t_comm, issue) + gather[u + 1]
            ready[u + 1] = t_comm
        t_comp = start + fwd_s[u]
    order = list(range(n - 1, -1, -1))
    ready = {}
    if zero3:
        first = order[0]
        t_comm = max(t_comm, t_comp) + gather[first]
        ready[first] = t_comm
    for j, u in enumerate(order):
        start = max(t_comp, ready.get(u, 0.0))
        if zero3 and j + 1 < len(order):
            nxt = order[j + 1]
            t_comm = max(t_comm, start if prefetch else start + bwd_s[u]) + gather[nxt]
            ready[nxt] = t_comm
        t_comp = start + bwd_s[u]
        t_comm = max(t_comm, t_comp) + reduce[u]
    compute = sum(fwd_s) + sum(bwd_s)
    return max(t_comp, t_comm) - compute, compute


def overlapped_gathers(compute_s: list[float], gather_s: list[float], prefetch: int) -> float:
    """Seconds the all-gathers of a chain of units add to its compute (prefetch 1: unit i+1's
    gather runs during unit i's compute)."""
    if not gather_s:
        return 0.0
    if not prefetch:
        return sum(gather_s)
    exposed = gather_s[0]
    for c, g in zip(compute_s, gather_s[1:]):
        exposed += max(0.0, g - c)
    return exposed


def optimizer_seconds(cluster, device, tensors: float, param_bytes_fp32: float, name: str,
                      dtensor: bool) -> float:
    """One optimizer step over ``tensors`` local tensors of ``param_bytes_fp32`` bytes: the
    measured per-tensor and per-byte costs (``measured.optimizer``), else the fp32 master
    weights, gradients and two AdamW states streamed from memory (28 bytes per parameter
    read or written) at the HBM bandwidth."""
    m = cluster.measured
    if m is not None:
        fit = m.optimizer.get(f"{name}_dtensor" if dtensor else name) or m.optimizer.get(name)
        if fit is not None:
            return tensors * fit.per_tensor_us * 1e-6 + param_bytes_fp32 / (fit.bandwidth_gb_s * 1e9)
    per_param = 28 if name == "adamw" else 12
    return param_bytes_fp32 / 4 * per_param / (cluster.hbm_bytes_per_s * 0.9)


def total(calls: list[Call]) -> float:
    return sum(c.total for c in calls)
