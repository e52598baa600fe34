"""Seconds of a list of kernels on one device: measured (the cluster's ``measured:`` section,
``parallelize calibrate``) where it was measured, the datasheet otherwise.

Measured (a calibrated cluster): a matmul takes the time the calibration's grid gives for
its (m, n, k) (achieved FLOP/s, interpolated in log space; at most the fastest measured call
below the grid), an attention call its measured FLOP/s for (batch x heads, sequence, head
dim), every other op ``latency + bytes / bandwidth`` and a view ``view_us``. On a CPU the
ops run one after the other, so the unit's time is their sum; on a GPU the host launches
them asynchronously, so it is max(host time, device time) (the host pays each op's latency).

Datasheet (no calibration): a matmul runs at the GPU's dense peak x its maximum achievable
matmul efficiency (``MATMUL_EFFICIENCY``: Bekman's published MAMF measurements) x the tile
and wave quantization of a 256 x 128 output tile over the GPU's SMs (NVIDIA, "Matrix
Multiplication Background User's Guide", tile and wave quantization), and never faster than
its operands stream from HBM; attention at ``ATTENTION_EFFICIENCY`` of peak (FlashAttention-2,
Dao 2023, §4.1: 50-73 % forward on A100); other ops at ``MEMORY_EFFICIENCY`` of the HBM
bandwidth; each kernel at least ``LAUNCH_S``. The last three are assumptions, stated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .kernels import Kernel

# Maximum achievable matmul FLOPS / dense peak, BF16 (S. Bekman, "Machine Learning Engineering",
# compute/accelerator, MAMF table, mamf-finder.py): A100 SXM 267.9 / 312, H100 SXM 792.1 / 989,
# GH200 821.0 / 989 (the H200's silicon and HBM3e: used for h200); B200 not measured there:
# the H100's figure is assumed.
MATMUL_EFFICIENCY = {"a100-40gb": 0.859, "a100-80gb": 0.859, "h100-sxm": 0.801,
                     "h200": 0.830, "b200": 0.801}
SMS = {"a100-40gb": 108, "a100-80gb": 108, "h100-sxm": 132, "h200": 132, "b200": 148}
TILE = (256, 128)
# a tensor-core GEMM tile loads stages x tile_k elements of k before its first MMA and writes
# its output tile after the last: CUTLASS's default A100 kernel (256 x 128 x 32, 4 stages)
# fills 128; the k loop's efficiency is k / (k + K_FILL)
K_FILL = 128
ATTENTION_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.9
LAUNCH_S = 5e-6
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Times:
    """Seconds of a kernel list: ``total`` (what the unit takes), and its parts: matmuls,
    attention, other ops (``memory``), and the host's per-op time (``host``)."""
    total: float = 0.0
    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    host: float = 0.0
    weight_grad: float = 0.0   # of ``total``: the weight-gradient matmuls (zero-bubble W)

    def __add__(self, o: "Times") -> "Times":
        return Times(*(a + b for a, b in zip(self.astuple(), o.astuple())))

    def scale(self, f: float) -> "Times":
        return Times(*(a * f for a in self.astuple()))

    def astuple(self) -> tuple:
        return (self.total, self.matmul, self.attention, self.memory, self.host, self.weight_grad)


class Device:
    """One rank's device for the step-time model (module docstring)."""

    def __init__(self, cluster, dtype: str | None = None):
        from .measured import Lookups
        self.cluster = cluster
        self.dtype = dtype or cluster.dtype
        self.measured = Lookups(cluster.measured) if cluster.measured is not None else None
        m = cluster.measured
        self.serial = m is not None and m.device_type == "cpu"
        self.elem = m.elementwise if m is not None else None
        self.peak = cluster.peak_flops_for(self.dtype)
        self.hbm = cluster.hbm_bytes_per_s
        self.mm_eff = cluster.matmul_efficiency
        self.sms = SMS.get(cluster.gpu_name, 108)
        self._cache: dict = {}

    @property
    def byte_scale(self) -> float:
        """Bytes of the compute dtype per fp32 byte (kernels are recorded in fp32)."""
        return DTYPE_BYTES[self.dtype] / 4

    @property
    def source(self) -> str:
        return "measured" if self.measured is not None else "datasheet"

    def times(self, kernels, backward: bool) -> Times:
        """Seconds of ``kernels`` (Kernel objects already at this rank's shapes and fp32
        byte counts; scaled here to the compute dtype)."""
        scale = self.byte_scale
        mm = attn = mem = host = wg = 0.0
        for k in kernels:
            t, h = self.kernel_s(k, scale, backward)
            host += h
            if k.kind == "mm":
                mm += t
                wg += t if k.weight_grad else 0.0
            elif k.kind == "attn":
                attn += t
            else:
                mem += t
        device = mm + attn + mem
        total = device + host if self.serial else max(device, host)
        if not self.serial and total > 0:
            wg *= total / max(device, 1e-30)
        return Times(total, mm, attn, mem, host, wg)

    def kernel_s(self, k: Kernel, scale: float, backward: bool) -> tuple[float, float]:
        """(device seconds, host seconds) of one kernel."""
        key = (k.kind, k.flops, k.bytes, k.dims, backward)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._kernel_s(k, scale, backward)
        return hit

    def _kernel_s(self, k: Kernel, scale: float, backward: bool) -> tuple[float, float]:
        e = self.elem
        if self.measured is not None and e is not None:
            lat = (e.backward_latency_us if backward else e.latency_us) * 1e-6
            if k.kind == "view":
                return 0.0, e.view_us * 1e-6
            if k.kind == "mm":
                t = self.measured.matmul_s(k.dims[1], k.dims[2], k.dims[3], self.dtype, k.dims[0])
                if t is not None:
                    return t, 0.0 if self.serial else lat
            if k.kind == "attn":
                t = self.measured.attention_s(*k.dims[:2], k.dims[3], k.flops, self.dtype, backward)
                if t is not None:
                    return t, 0.0 if self.serial else lat
            if k.kind == "elem":
                return k.bytes * scale / (e.bandwidth_gb_s * 1e9), lat
        return self._datasheet(k, scale), 0.0

    def _datasheet(self, k: Kernel, scale: float) -> float:
        if k.kind == "view":
            return 0.0
        memory = k.bytes * scale / (self.hbm * MEMORY_EFFICIENCY)
        if k.kind == "mm":
            b, m, n, _ = k.dims
            tiles = b * math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
            waves = math.ceil(tiles / self.sms)
            useful = (b * m * n) / (waves * self.sms * TILE[0] * TILE[1])
            fill = k.dims[3] / (k.dims[3] + K_FILL)   # the k loop's pipeline fill and epilogue
            compute = k.flops / (self.peak * self.mm_eff * min(1.0, useful) * fill)
            return max(compute, memory, LAUNCH_S)
        if k.kind == "attn":
            return max(k.flops / (self.peak * ATTENTION_EFFICIENCY), memory, LAUNCH_S)
        return max(memory, LAUNCH_S)
