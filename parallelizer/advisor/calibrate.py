"""``parallelize calibrate``'s compute measurements, run on every rank at once (the ranks of a
training job share a node's CPU cores, memory bandwidth and power, so each figure is what a
rank achieves while all the others work too).

- matmul: achieved FLOP/s of ``torch.mm`` on a full grid of (m, n, k) per dtype;
- attention: ``scaled_dot_product_attention`` (causal) forward and backward FLOP/s on a grid
  of (batch x heads, sequence, head dim), FLOPs counted by torch's own formulas
  (``torch.utils.flop_counter``), as the step-time model counts them;
- elementwise: the per-op latency of forward and backward ops under autograd, of a view, and
  the bandwidth (bytes read + written per second) of large elementwise ops;
- optimizer: one AdamW / SGD step over lists of tensors: per tensor and per byte, on plain
  tensors and on DTensors (FSDP2's sharded parameters).

Every figure is the median of repeated timings of a call (sized to take at least
``Sizes.min_s``), then the median over ranks. The grids' sizes (:data:`MODES`) keep the quick
mode within about a minute on a CPU and seconds on a GPU.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import OpRecorder


@dataclass(frozen=True)
class Sizes:
    mm: tuple            # axis values of the (m, n, k) grid
    attn_bh: tuple
    attn_seq: tuple
    attn_dim: tuple
    elem: tuple          # element counts for the bandwidth fit
    comm: tuple          # bytes per collective
    reps: int            # timed repetitions per measurement (median)
    min_s: float         # a repetition runs the call enough times to take this long
    dtypes: tuple = ()   # extra dtypes beyond the cluster's


MODES = {
    ("quick", "cpu"): Sizes((16, 64, 256, 1024), (4, 16), (16, 128, 512), (16, 64),
                            (1 << 12, 1 << 16, 1 << 20), (1 << 10, 1 << 14, 1 << 18, 1 << 22), 5, 2e-3),
    ("thorough", "cpu"): Sizes((8, 16, 32, 64, 128, 256, 512, 1024, 2048), (2, 8, 32), (16, 64, 256, 1024),
                               (16, 32, 64, 128), (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24),
                               tuple(1 << k for k in range(8, 27, 2)), 9, 5e-3, ("fp32", "bf16")),
    ("quick", "cuda"): Sizes((256, 1024, 4096, 16384), (8, 64), (512, 2048, 8192), (64, 128),
                             (1 << 16, 1 << 22, 1 << 26), (1 << 16, 1 << 20, 1 << 24, 1 << 28), 5, 5e-3),
    ("thorough", "cuda"): Sizes((128, 256, 512, 1024, 2048, 4096, 8192, 16384), (4, 16, 64, 256),
                                (256, 1024, 4096, 16384), (64, 128, 256), (1 << 14, 1 << 18, 1 << 22, 1 << 26, 1 << 28),
                                tuple(1 << k for k in range(12, 31, 2)), 9, 1e-2, ("bf16", "fp16", "fp32")),
    ("test", "cpu"): Sizes((16, 128), (4,), (16, 64), (16,), (1 << 10, 1 << 16), (1 << 10, 1 << 16), 3, 5e-4),
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Timer:
    """Median seconds per call of ``fn`` on ``device``, every rank timing at once."""

    def __init__(self, device: torch.device, sizes: Sizes, world: int):
        self.device, self.sizes, self.world = device, sizes, world

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def __call__(self, fn) -> float:
        self.barrier()
        fn()
        self.sync()
        inner, t = 1, self._once(fn, 1)
        while t < self.sizes.min_s and inner < 1 << 16:
            inner *= max(2, min(64, int(self.sizes.min_s / max(t, 1e-9))))
            t = self._once(fn, inner)
        inner = self.agree(inner)   # every rank the same count: all of them busy together
        times = []
        for _ in range(self.sizes.reps):
            self.barrier()
            times.append(self._once(fn, inner))
        return self.across_ranks(statistics.median(times) / inner)

    def agree(self, inner: int) -> int:
        if self.world == 1:
            return inner
        t = torch.tensor([inner], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _once(self, fn, inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        self.sync()
        return time.perf_counter() - t0

    def across_ranks(self, value: float) -> float:
        """The median over ranks of a figure each rank measured."""
        if self.world == 1:
            return value
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return float(statistics.median(out))


def matmul_grid(timer: Timer, dtype: str) -> list:
    """[m, n, k, TFLOP/s] on the full grid of ``timer.sizes.mm``."""
    axis, dev, dt = timer.sizes.mm, timer.device, TORCH_DTYPES[dtype]
    out = []
    for m in axis:
        for n in axis:
            for k in axis:
                a = torch.randn(m, k, device=dev, dtype=dt)
                b = torch.randn(k, n, device=dev, dtype=dt)
                s = timer(lambda: torch.mm(a, b))
                out.append([m, n, k, round(2.0 * m * n * k / s / 1e12, 9)])
    return out


def attention_grid(timer: Timer, dtype: str) -> list:
    """[batch x heads, seq, head dim, forward TFLOP/s, backward TFLOP/s], causal SDPA."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    sz, dev, dt = timer.sizes, timer.device, TORCH_DTYPES[dtype]
    out = []
    for bh in sz.attn_bh:
        for s in sz.attn_seq:
            for d in sz.attn_dim:
                shape = (1, bh, s, d)
                q, k, v = (torch.randn(shape, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
                sdpa = torch.nn.functional.scaled_dot_product_attention
                fwd = timer(lambda: sdpa(q, k, v, is_causal=True))
                o = sdpa(q, k, v, is_causal=True)
                g = torch.ones_like(o)

                def both():
                    torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), g)
                total = timer(both)
                bwd = max(total - fwd, 1e-9)
                out.append([bh, s, d, round(sdpa_flop_count(shape, shape, shape) / fwd / 1e12, 9),
                            round(sdpa_backward_flop_count(shape, shape, shape, shape) / bwd / 1e12, 9)])
    return out


def elementwise(timer: Timer, matmul: list, attention: list) -> dict:
    """Per-op latency of forward and backward ops, of a view, and the bandwidth of large ops.

    The bandwidth is a least-squares fit of time = latency + bytes / bandwidth over large
    ``torch.add`` calls. The latencies come from four small Llama-like blocks (norm, q/k/v,
    SDPA, output projection, SwiGLU MLP, residuals; 32 tokens, hidden 64) run forward and
    backward as the emitted programs run them (``torch.ops.aten`` overloads, autograd on):
    their time less what the matmul and attention grids give for their matmuls and attention
    calls, the views and the bytes, over their other ops, counted by the same
    :class:`~parallelizer.advisor.kernels.OpRecorder` the step-time model's inventory uses."""
    from .measured import Lookups, Measured
    dev = timer.device
    sizes, times = [], []
    for n in timer.sizes.elem:
        a, b = torch.randn(n, device=dev), torch.randn(n, device=dev)
        c = torch.empty(n, device=dev)
        sizes.append(12.0 * n)  # two fp32 reads, one write
        times.append(timer(lambda: torch.add(a, b, out=c)))
    _, inv_bw = fit_line(sizes, times)
    base = torch.randn(32, 64, device=dev)
    t_view = timer(lambda: [torch.ops.aten.t.default(base) for _ in range(40)]) / 40
    block = _Blocks(dev)
    with OpRecorder() as rec_f:
        y = block()
    seed = torch.ones_like(y)
    with OpRecorder(True) as rec_b:
        torch.autograd.grad(y, block.inputs, seed)
    t_fwd = timer(block)
    y = block()
    t_bwd = timer(lambda: torch.autograd.grad(y, block.inputs, seed, retain_graph=True))
    table = Lookups(Measured(date="", device="", backend="", ranks=1, matmul={"fp32": matmul},
                             attention={"fp32": attention}))
    lat_f = _per_op(rec_f.kernels, t_fwd, table, t_view, inv_bw, False)
    lat_b = _per_op(rec_b.kernels, t_bwd, table, t_view, inv_bw, True)
    return {"latency_us": round(lat_f * 1e6, 3), "backward_latency_us": round(lat_b * 1e6, 3),
            "view_us": round(t_view * 1e6, 3), "bandwidth_gb_s": round(1 / inv_bw / 1e9, 3)}


def _per_op(kernels, seconds, table, view_s, inv_bw, backward) -> float:
    """(seconds - matmuls - attention - views - bytes / bandwidth) / other ops."""
    rest, ops = seconds, 0
    for k in kernels:
        if k.kind == "mm":
            rest -= table.matmul_s(k.dims[1], k.dims[2], k.dims[3], "fp32", k.dims[0]) or 0.0
        elif k.kind == "attn":
            rest -= table.attention_s(k.dims[0], k.dims[1], k.dims[3], k.flops, "fp32", backward) or 0.0
        elif k.kind == "view":
            rest -= view_s
        else:
            rest -= k.bytes * inv_bw
            ops += 1
    return max(rest / max(ops, 1), 0.5e-6)


class _Blocks:
    """Four small Llama-like blocks in ``torch.ops.aten`` calls (see :func:`elementwise`)."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()  # noqa: E731
        self.x = mk(2, 16, 64)
        self.w = [mk(64, 64) for _ in range(4)] + [mk(128, 64), mk(64, 128)]
        self.norm = mk(64)
        self.inputs = [self.x, self.norm] + self.w

    def __call__(self):
        y = self.x
        for _ in range(4):
            y = self._block(y)
        return y

    def _block(self, x):
        aten, w = torch.ops.aten, self.w
        v = aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True)
        h = aten.mul.Tensor(aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Tensor(v, 1e-6))), self.norm)
        q, k, vv = (aten.transpose.int(aten.view.default(aten.linear.default(h, w[i]), [2, 16, 4, 16]), 1, 2)
                    for i in range(3))
        a = aten.scaled_dot_product_attention.default(q, k, vv, is_causal=True)
        x = aten.add.Tensor(x, aten.linear.default(aten.reshape.default(aten.transpose.int(a, 1, 2),
                                                                        [2, 16, 64]), w[3]))
        u = aten.linear.default(x, w[4])
        return aten.add.Tensor(x, aten.linear.default(aten.mul.Tensor(aten.silu.default(u), u), w[5]))


def optimizer(timer: Timer, mesh=None) -> dict:
    """AdamW and SGD steps (torch.optim, the runtime's defaults) over 16 tensors of 4 Ki and
    of 256 Ki fp32 elements: per tensor and per parameter byte; with ``mesh`` also over
    DTensors sharded on it (``<name>_dtensor``)."""
    out = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        for suffix, shard in (("", False), ("_dtensor", True)):
            if shard and mesh is None:
                continue
            points = []
            for numel in (1 << 12, 1 << 18):
                params = _params(16, numel, timer.device, mesh if shard else None)
                opt = cls(params, lr=1e-4)
                points.append((16, 16 * numel * 4, timer(opt.step)))
            (n1, b1, t1), (n2, b2, t2) = points
            per_byte = max((t2 - t1) / (b2 - b1), 1e-15)
            per_tensor = max((t1 - b1 * per_byte) / n1, 0.0)
            out[name + suffix] = {"per_tensor_us": round(per_tensor * 1e6, 3),
                                  "bandwidth_gb_s": round(1 / per_byte / 1e9, 3)}
    return out


def _params(count: int, numel: int, device, mesh) -> list:
    params = []
    for _ in range(count):
        t = torch.randn(numel * (mesh.size() if mesh is not None else 1), device=device)
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor
            t = distribute_tensor(t, mesh, [Shard(0)])
        p = torch.nn.Parameter(t)
        p.grad = torch.randn_like(p)
        params.append(p)
    return params


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` weighted to relative error, with a, b >= 0."""
    w = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    if b <= 0:
        b = max(ys) / max(xs) * 1e-3 + 1e-18
    if a < 0:
        a = 0.0
        b = sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / max(sum(wi * x * x for wi, x in zip(w, xs)), 1e-30)
    return a, b
