"""``parallelize calibrate``'s collective measurements: α and β of all-reduce, all-gather,
reduce-scatter, all-to-all and send/recv for every group size a layout can use.

Groups inside a node (``intra_node``): the node's ranks split into groups of g consecutive
ranks, all groups of a split running the collective at once (as the tp or dp groups of a
job do). Across nodes (``inter_node``, when there are several): groups of one rank per node
(the same local rank), for every g dividing the node count. For each size in
``Sizes.comm`` the time of one call is the median of repeated back-to-back calls, the
slowest rank's; ``time = latency + moved / bandwidth`` (``advisor/measured.py``: moved =
2 (g-1)/g n for an all-reduce, (g-1)/g n for the others, n for a send) is fitted to them,
weighted to relative error. send/recv is a ping-pong between pairs: half a round trip.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .calibrate import fit_line
from .measured import COLLECTIVES, moved_fraction


def groups(world: int, local: int) -> dict:
    """scope -> group size -> the rank lists of one split (every rank in one group)."""
    out: dict = {"intra_node": {}}
    nodes = world // local
    for g in (d for d in range(2, local + 1) if local % d == 0):
        out["intra_node"][g] = [list(range(s, s + g)) for s in range(0, world, g)]
    if nodes > 1:
        out["inter_node"] = {}
        for g in (d for d in range(2, nodes + 1) if nodes % d == 0):
            out["inter_node"][g] = [[lr + local * (n0 + i) for i in range(g)]
                                    for n0 in range(0, nodes, g) for lr in range(local)]
    return out


def measure_collectives(sizes, device, world: int, local: int, reps: int) -> dict:
    """scope -> op -> group size -> {latency_us, bandwidth_gb_s} (module docstring)."""
    rank = dist.get_rank()
    out: dict = {}
    for scope, by_size in groups(world, local).items():
        for g, split in by_size.items():
            handles = [dist.new_group(ranks) for ranks in split]   # every rank makes every group
            mine = next(i for i, ranks in enumerate(split) if rank in ranks)
            group, ranks = handles[mine], split[mine]
            for op in COLLECTIVES:
                if op == "send_recv" and g != 2:
                    continue  # a point-to-point pair: measured once per scope
                fit = _measure(op, group, ranks, g, sizes, device, reps)
                if fit is not None:
                    out.setdefault(scope, {}).setdefault(op, {})[g] = fit
    return out


def _measure(op, group, ranks, g, sizes, device, reps):
    xs, ys = [], []
    for n in sizes:
        t = _time(op, group, ranks, g, n, device, reps)
        if t is None:
            return None
        xs.append(moved_fraction(op, g) * n)
        ys.append(t)
    a, b = fit_line(xs, ys)
    busy = _busy(op, group, ranks, g, sizes[0], device, reps) - xs[0] * b
    return {"latency_us": round(a * 1e6, 3), "bandwidth_gb_s": round(1 / b / 1e9, 4),
            "busy_latency_us": round(max(busy, 0.0) * 1e6, 3)}


BURST_S = 1.5e-3  # compute between two collectives of a step (a block's attention or MLP)


def _busy(op, group, ranks, g, nbytes, device, reps) -> float:
    """Seconds a call adds between bursts of compute (``BURST_S`` of small matmuls): the
    slowest rank's median of (burst + call) - burst."""
    n = max(g, int(nbytes) // 4 // g * g)
    call = _call(op, group, ranks, g, torch.ones(n, device=device))
    a, b = torch.randn(128, 64, device=device), torch.randn(64, 64, device=device)
    t0 = time.perf_counter()
    for _ in range(8):
        torch.mm(a, b)
    _sync(device)
    inner = max(1, int(round(_slowest(BURST_S / max((time.perf_counter() - t0) / 8, 1e-7), device))))

    def burst():
        for _ in range(inner):
            torch.mm(a, b)
    both, alone = [], []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(8):
            burst()
            call()
        _sync(device)
        both.append((time.perf_counter() - t0) / 8)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(8):
            burst()
        _sync(device)
        alone.append((time.perf_counter() - t0) / 8)
    extra = statistics.median(both) - statistics.median(alone)
    return _slowest(max(extra, 0.0), device) / (2 if op == "send_recv" else 1)


def _time(op, group, ranks, g, nbytes, device, reps) -> float | None:
    """Seconds of one call, the slowest rank's median (None: the backend lacks the op)."""
    n = max(g, int(nbytes) // 4 // g * g)
    x = torch.ones(n, device=device)
    call = _call(op, group, ranks, g, x)
    try:
        call()
        _sync(device)
        inner = 1
        t = _slowest(_once(call, inner, device, group), device)
        while t < 2e-3 and inner < 1024:  # every rank the same count: they decide together
            inner *= 4
            t = _slowest(_once(call, inner, device, group), device)
        times = [_once(call, inner, device, group) / inner for _ in range(reps)]
    except (RuntimeError, ValueError, NotImplementedError):
        _bail(group)
        return None
    return _slowest(statistics.median(times), device) / (2 if op == "send_recv" else 1)


def _slowest(seconds: float, device) -> float:
    worst = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _call(op, group, ranks, g, x):
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        out, part = torch.empty_like(x), x[: x.numel() // g]
        return lambda: dist.all_gather_into_tensor(out, part, group=group)
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // g, device=x.device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    me = dist.get_rank()
    i = ranks.index(me)
    peer = ranks[i ^ 1] if (i ^ 1) < len(ranks) else None

    def ping_pong():
        if peer is None:
            return
        if i % 2 == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    return ping_pong


def _once(call, inner, device, group) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(inner):
        call()
    _sync(device)
    return time.perf_counter() - t0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bail(group) -> None:
    """A backend without the op fails on every rank alike; wait for the others."""
    dist.barrier()
