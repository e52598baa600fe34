"""The kernels of a transformer given by its shape (``--model-shape``), per unit and microbatch:
what :mod:`parallelizer.advisor.inventory` records from a captured graph, written out for a
GPT block (Megatron-LM's fused kernels: LayerNorm, bias-GeLU, bias-dropout-add, scale-mask-
softmax; Shoeybi et al. 2019 and Narayanan et al. 2021) or a Llama block (RMSNorm, SwiGLU,
rotary embeddings), at b sequences of s tokens, hidden h, a heads (kv key/value heads),
feed-forward f, vocabulary V.

``attention`` is how the scores are computed: ``flash`` (a fused SDPA / FlashAttention
kernel: the a x s x s scores never reach memory; Dao et al. 2022) or ``eager`` (two batched
matmuls with the scores, their softmax and dropout in memory, as Megatron-LM ran in 2021).
Byte counts are in fp32 units (4 bytes an element; the device model scales them to the
compute dtype), read plus written, the way :class:`~parallelizer.advisor.kernels.OpRecorder`
counts them. Backward: each matmul's input and weight gradients, each memory-bound op's
gradient kernel reading its saved input and the incoming gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from .inventory import UnitKernels
from .kernels import Kernel, grouped_mm

E = 4  # bytes of an element in the fp32 units the device model scales


def _mm(m, n, k, batch=1, weight=True):
    """Forward matmul (batch, m, n, k) and its two backward matmuls (input grad, weight grad)."""
    moved = E * batch * (m * k + k * n + m * n)
    f = Kernel("mm", 2.0 * batch * m * n * k, moved, (batch, m, n, k))
    dgrad = Kernel("mm", f.flops, moved, (batch, m, k, n), False, True)
    wgrad = Kernel("mm", f.flops, moved, (batch, n, k, m), weight, True)
    return f, (dgrad, wgrad)


def _elem(n_read, n_written, bwd_factor=1.5):
    """A memory-bound op over element counts; its backward reads the saved input and the
    gradient and writes the input gradient (``bwd_factor`` x its forward traffic)."""
    f = Kernel("elem", 0.0, E * (n_read + n_written))
    return f, (Kernel("elem", 0.0, E * (n_read + n_written) * bwd_factor, backward=True),)


@dataclass
class ShapeKernels:
    """Per-unit kernels of ``shape`` (see :func:`parallelizer.advisor.workload.parse_shape`)."""
    shape: dict
    attention: str = "flash"
    _cache: dict = field(default_factory=dict)

    def units(self, b: int) -> tuple[UnitKernels, ...]:
        if b not in self._cache:
            block = self._block(b)
            L = self.shape["layers"]
            self._cache[b] = (self._embedding(b),) + (block,) * L + (self._head(b),)
        return self._cache[b]

    def _dims(self, b):
        s = self.shape
        h, a = s["hidden"], s["heads"]
        kv, glu = s.get("kv_heads", a), s.get("glu", 0)
        return b * s["seq"], s["seq"], h, a, kv, s.get("ffn", 4 * h), glu

    def _block(self, b: int) -> UnitKernels:
        T, s, h, a, kv, f, glu = self._dims(b)
        d = h // a
        fwd, bwd = [], []

        def add(role, size, pair):
            fwd.append((role, size, pair[0]))
            bwd.extend((role, size, k) for k in pair[1])

        qkv = h + 2 * d * kv
        add("seq", 0, _elem(T * h, T * h))                       # input norm
        add("column", qkv, _mm(T, qkv, h))                       # q, k, v
        if glu:
            add("shard", 0, _elem(2 * T * (h + d * kv), T * (h + d * kv)))   # rotary on q, k
        self._attention(add, b, s, a, kv, d)
        add("row", h, _mm(T, h, h))                              # output projection
        add("seq", 0, _elem(2 * T * h + h, T * h * (1 if glu else 1.25)))    # (bias-dropout-)add
        add("seq", 0, _elem(T * h, T * h))                       # post-attention norm
        sites = (("f", E * T * h), ("g", E * T * h))
        if self.shape.get("experts"):   # experts' FFN dim split over tp: f / g on their rows
            self._moe(add, T, h, glu)
            rows = T * self.shape.get("topk", 2)
            sites += (("ef", E * rows * h), ("eg", E * rows * h))
        else:
            add("column", (2 if glu else 1) * f, _mm(T, (2 if glu else 1) * f, h))
            add("shard", 0, _elem(2 * T * f, T * f) if glu else _elem(T * f + f, T * f))  # SwiGLU / bias-GeLU
            add("row", f, _mm(T, h, f))
            sites += (("f", E * T * h), ("g", E * T * h))
        add("seq", 0, _elem(2 * T * h + h, T * h * (1 if glu else 1.25)))
        return UnitKernels(tuple(fwd), tuple(bwd), sites)

    def _moe(self, add, T, h, glu):
        """A mixture-of-experts MLP (Mixtral's, transformers' grouped-mm experts): the router,
        its softmax and top-k, the (token, expert) rows gathered in expert order, two grouped
        matmuls (gate|up, down) with the activation between, and the rows weighted by the
        router and summed back per token. Balanced routing: T k / experts rows per expert."""
        x, k = self.shape["experts"], self.shape.get("topk", 2)
        f = self.shape.get("moe_ffn", self.shape.get("ffn", 4 * h))
        R = T * k
        add("seq", 0, _mm(T, x, h))                                   # router
        add("seq", 0, _elem(T * x, T * x + 2 * T * k))                # softmax, top-k
        add("seq", 0, _elem(T * h, R * h))                            # rows in expert order
        n = (2 if glu else 1) * f
        add("seq", 0, grouped_mm(x, R, n, h, n, (f,)))                # gate|up (or fc1)
        add("shard", 0, _elem(2 * R * f, R * f) if glu else _elem(R * f, R * f))  # SwiGLU / GeLU
        add("seq", 0, grouped_mm(x, R, h, f, f, (f,)))                # down (or fc2)
        add("seq", 0, _elem(R * h + R, T * h))                        # weighted, summed per token

    def _attention(self, add, b, s, a, kv, d):
        if self.attention == "flash":
            q, k = (b, a, s, d), (b, a, s, d)
            f = Kernel("attn", float(sdpa_flop_count(q, k, k)), E * 4 * b * a * s * d, (b * a, s, s, d))
            g = Kernel("attn", float(sdpa_backward_flop_count(q, q, k, k)), E * 8 * b * a * s * d,
                       (b * a, s, s, d), False, True)
            add("shard", 0, (f, (g,)))
            return
        add("shard", 0, _mm(s, s, d, batch=b * a, weight=False))            # scores q k^T
        add("shard", 0, _elem(b * a * s * s, b * a * s * s))                 # scale-mask-softmax
        add("shard", 0, _elem(b * a * s * s, b * a * s * s * 1.25))          # dropout (+ mask)
        add("shard", 0, _mm(s, d, s, batch=b * a, weight=False))            # probabilities x v

    def _embedding(self, b: int) -> UnitKernels:
        T, s, h, *_ = self._dims(b)
        V = self.shape["vocab"]
        glu = self.shape.get("glu", 0)
        f = Kernel("elem", 0.0, E * (2 * T * h + (0 if glu else 2 * T * h)))   # lookup (+ positions)
        g = Kernel("elem", 0.0, E * (V * h + 2 * T * h), backward=True)      # scatter-add into the table
        return UnitKernels((("shard", 0, f),), (("shard", 0, g),), (("g", E * T * h),))

    def _head(self, b: int) -> UnitKernels:
        T, s, h, *_ = self._dims(b)
        V = self.shape["vocab"]
        fwd, bwd = [], []
        norm = _elem(T * h, T * h)
        fwd.append(("seq", 0, norm[0]))
        bwd.append(("seq", 0, norm[1][0]))
        head = _mm(T, V, h)
        fwd.append(("column", V, head[0]))
        bwd.extend(("column", V, k) for k in head[1])
        loss = _elem(T * V, T * V, bwd_factor=1.5)                          # cross-entropy (fp32)
        fwd.append(("shard", 0, loss[0]))
        bwd.append(("shard", 0, loss[1][0]))
        return UnitKernels(tuple(fwd), tuple(bwd), (("f", E * T * h),))
