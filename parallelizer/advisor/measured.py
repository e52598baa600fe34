"""The cluster file's ``measured:`` section, written by ``parallelize calibrate``, and the
lookups the step-time model makes in it.

    measured:
      date: '2026-12-01T22:30:00'
      device: AMD EPYC 7B13 (cpu), 4 ranks on 1 node, gloo, torch 2.13.0+cpu
      backend: gloo
      device_type: cpu
      ranks: 4
      nodes: 1
      mode: quick
      matmul:                 # dtype -> [m, n, k, achieved TFLOP/s] on a full grid
        fp32: [[16, 16, 16, 0.0004], ...]
      attention:              # dtype -> [batch x heads, seq, head_dim, fwd TFLOP/s, bwd TFLOP/s]
        fp32: [[4, 16, 16, 0.0002, 0.0001], ...]
      elementwise: {latency_us: 6.1, backward_latency_us: 4.0, view_us: 2.2, bandwidth_gb_s: 9.5}
      optimizer:              # one step over a list of tensors: per tensor + per byte of parameters
        adamw: {per_tensor_us: 60.0, bandwidth_gb_s: 1.1}
      collectives:            # scope -> op -> group size -> time = latency + bus bytes / bandwidth
        intra_node:
          all_reduce: {2: {latency_us: 150.0, bandwidth_gb_s: 1.9}, 4: {...}}
      pipeline: {action_us: 900.0}   # torch.distributed.pipelining's host time per compute action

Every figure is what all ranks achieved at once (they run each measurement together, as
the ranks of a training job share the node), the median over ranks. Collective bandwidths are
bus bandwidths in the nccl-tests convention: an all-reduce of n bytes over g ranks moves
2 (g-1)/g n bytes per rank, a reduce-scatter or all-gather (g-1)/g n, an all-to-all (g-1)/g n,
a send n; ``time = latency + moved / bandwidth``.
"""
from __future__ import annotations

import bisect
import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", frozen=True)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def moved_fraction(op: str, g: int) -> float:
    """Bytes a rank moves per byte of the full tensor (ring algorithms; Thakur et al. 2005)."""
    if g <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (g - 1) / g
    if op == "send_recv":
        return 1.0
    return (g - 1) / g


class Fit(BaseModel):
    """``latency_us``: per call, back to back; ``busy_latency_us``: per call between bursts of
    compute, as a training step interleaves them (on a CPU whose cores the ranks share, a
    rank waiting in a collective waits for its peers to be scheduled); the step-time model
    uses the busy figure when there is one."""
    model_config = _STRICT
    latency_us: float = Field(ge=0, description="a number >= 0 (microseconds per call)")
    bandwidth_gb_s: float = Field(gt=0, description="a number > 0 (GB/s of bus bandwidth)")
    busy_latency_us: Optional[float] = Field(None, ge=0, description="null or a number >= 0")

    def seconds(self, moved_bytes: float) -> float:
        lat = self.latency_us if self.busy_latency_us is None else max(self.latency_us, self.busy_latency_us)
        return lat * 1e-6 + moved_bytes / (self.bandwidth_gb_s * 1e9)


class Elementwise(BaseModel):
    model_config = _STRICT
    latency_us: float = Field(ge=0, description="a number >= 0 (per forward op, autograd on)")
    backward_latency_us: float = Field(ge=0, description="a number >= 0 (per backward op)")
    view_us: float = Field(ge=0, description="a number >= 0 (per view / metadata op)")
    bandwidth_gb_s: float = Field(gt=0, description="a number > 0 (bytes read + written per s)")


class Optimizer(BaseModel):
    model_config = _STRICT
    per_tensor_us: float = Field(ge=0, description="a number >= 0")
    bandwidth_gb_s: float = Field(gt=0, description="a number > 0 (parameter bytes per s)")


class Pipeline(BaseModel):
    """Host seconds torch's pipelining runtime adds to each compute action
    (``advisor/calibrate_pipe.py``)."""
    model_config = _STRICT
    action_us: float = Field(ge=0, description="a number >= 0 (microseconds per action)")


class Measured(BaseModel):
    """The ``measured:`` section (module docstring)."""
    model_config = _STRICT
    date: str
    device: str
    backend: str
    device_type: Literal["cpu", "cuda"] = "cpu"
    ranks: int = Field(ge=1)
    nodes: int = Field(1, ge=1)
    mode: Literal["quick", "thorough", "test"] = "quick"
    matmul: dict[str, list[list[float]]] = Field(default_factory=dict)
    attention: dict[str, list[list[float]]] = Field(default_factory=dict)
    elementwise: Optional[Elementwise] = None
    optimizer: dict[str, Optimizer] = Field(default_factory=dict)
    collectives: dict[str, dict[str, dict[int, Fit]]] = Field(default_factory=dict)
    pipeline: Optional[Pipeline] = None


class Grid:
    """Achieved rate on a full grid of points (axes in log2), interpolated multilinearly in
    log(rate) and clamped at the grid's edges: beyond the largest point the rate stays (the
    caller keeps the time of the fastest measured call as a floor below the smallest)."""

    def __init__(self, points: list[tuple], value: int):
        self.axes = [sorted({p[i] for p in points}) for i in range(value)]
        self.table = {tuple(p[:value]): max(p[value], 1e-30) for p in points}
        missing = [c for c in _corners(self.axes) if c not in self.table]
        if missing:
            raise ValueError(f"measured grid is not full: missing {missing[:3]}")

    def rate(self, coords) -> float:
        idx = []
        for axis, x in zip(self.axes, coords):
            x = min(max(x, axis[0]), axis[-1])
            j = min(max(bisect.bisect_right(axis, x) - 1, 0), max(len(axis) - 2, 0))
            lo, hi = axis[j], axis[min(j + 1, len(axis) - 1)]
            w = 0.0 if hi == lo else (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
            idx.append(((lo, 1 - w), (hi, w)))
        total = 0.0
        for corner in _product(idx):
            key = tuple(c for c, _ in corner)
            weight = math.prod(w for _, w in corner)
            if weight:
                total += weight * math.log(self.table[key])
        return math.exp(total)


def _corners(axes):
    out = [()]
    for axis in axes:
        out = [c + (x,) for c in out for x in axis]
    return out


def _product(idx):
    out = [()]
    for pair in idx:
        out = [c + (p,) for c in out for p in pair]
    return out


class Lookups:
    """The measured section made fast to query (built once per cluster)."""

    def __init__(self, m: Measured):
        self.m = m
        self._mm = {d: _grid(pts, 3) for d, pts in m.matmul.items() if pts}
        self._attn = {d: (_grid([p[:4] for p in pts], 3), _grid([p[:3] + [p[4]] for p in pts], 3))
                      for d, pts in m.attention.items() if pts}
        self._mm_floor = {d: min(2 * p[0] * p[1] * p[2] / (p[3] * 1e12) for p in pts)
                          for d, pts in m.matmul.items() if pts}

    def matmul_s(self, m: float, n: float, k: float, dtype: str, batch: float = 1) -> float | None:
        grid = self._mm.get(dtype) or self._mm.get("fp32")
        if grid is None:
            return None
        flops = 2 * batch * m * n * k
        rate = grid.rate((m * batch, n, k)) * 1e12
        floor = self._mm_floor.get(dtype, self._mm_floor.get("fp32", 0.0))
        return max(flops / rate, floor)

    def attention_s(self, bh: float, s: float, d: float, flops: float, dtype: str,
                    backward: bool) -> float | None:
        grids = self._attn.get(dtype) or self._attn.get("fp32")
        if grids is None:
            return None
        return flops / (grids[1 if backward else 0].rate((bh, s, d)) * 1e12)

    def collective(self, op: str, g: int, scope: str) -> Fit | None:
        table = self.m.collectives.get(scope) or {}
        fits = table.get(op) or (table.get("all_gather") if op == "reduce_scatter" else None)
        if not fits:
            return None
        if g in fits:
            return fits[g]
        sizes = sorted(fits)
        # a group size not measured: the nearest measured one (latency grows ~ with g - 1)
        near = min(sizes, key=lambda x: abs(math.log(x) - math.log(g)))
        fit = fits[near]
        scale = (g - 1) / max(near - 1, 1)
        return Fit(latency_us=fit.latency_us * scale, bandwidth_gb_s=fit.bandwidth_gb_s,
                   busy_latency_us=None if fit.busy_latency_us is None else fit.busy_latency_us * scale)


def _grid(points, value):
    return Grid([tuple(p) for p in points], value)
