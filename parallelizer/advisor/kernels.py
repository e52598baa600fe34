"""What one microbatch runs, kernel by kernel: the step-time model's view of a unit.

A :class:`Kernel` is one ATen op as the device executes it: a matmul (``mm``: batch, m, n,
k), an attention call (``attn``: batch x heads, query and key length, head dim), a view
(``view``: metadata only, a dispatch and nothing else) or any other op (``elem``: bytes read
plus bytes written). :class:`OpRecorder` is a ``TorchDispatchMode`` that turns the ops it sees
into kernels; :func:`record_node` runs one fx node forward and backward on FakeTensors of the
concrete shapes under it, so a unit's kernels are what autograd really dispatches, in both
directions (``linear`` -> ``t`` + ``addmm``, its backward -> two ``mm`` and a ``sum``).
Backward matmuls that produce a parameter's gradient are marked ``weight_grad`` (the ``W``
actions of zero-bubble schedules, Qi et al. 2024, §2).

Tensor parallelism scales a node's kernels by its role (:data:`ROLES`): ``column`` /
``row`` linears divide the output / input features by tp (Megatron-LM, Shoeybi et al. 2019,
§3), ``shard`` nodes (between them: heads, the MLP's inner features, a vocab-parallel
embedding, head and loss) all sizes, ``seq`` nodes (the replicated norms and residual adds of
a block) only under sequence parallelism (Korthikanti et al. 2022, §4.2.2), and
``replicated`` nodes never.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
ROLES = ("column", "row", "shard", "seq", "replicated")
_MM = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_FREE = {aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset}
_ALIASES = {aten.detach, aten.alias, aten.lift_fresh, aten._unsafe_view}  # no data moved


@dataclass(frozen=True)
class Kernel:
    """One op. ``dims``: mm (batch, m, n, k); attn (batch x heads, q len, kv len, head dim).
    ``flops`` (mm, attn) and ``bytes`` (elem: read + written; mm/attn: operands and result)
    are for the shapes recorded; ``weight_grad``: a backward matmul giving a weight gradient."""
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    dims: tuple = ()
    weight_grad: bool = False
    backward: bool = False
    experts: int = 0      # a grouped matmul over this many experts (batch dim), else 0
    rows_at: int = 1      # which of ``dims`` is each expert's rows (3 for the weight gradient)
    ffn: float = 0.0      # a grouped matmul's FFN-dim length, which tp splits (0: kept whole)
    tp_sizes: tuple = ()  # sizes tp must divide for that split (``MoELayer.tp_sizes``)

    def regrouped(self, ep: int) -> "Kernel":
        """A grouped matmul on one of ``ep`` ranks at balanced routing: E/ep experts, each
        with ep x the rows (the ep group's rows routed to it); FLOPs unchanged, the weights'
        bytes 1/ep. Other kernels unchanged."""
        if ep == 1 or not self.experts:
            return self
        dims = list(self.dims)
        dims[0], dims[self.rows_at] = dims[0] / ep, dims[self.rows_at] * ep
        return replace(self, dims=tuple(dims), bytes=_grouped_bytes(*dims))

    def sharded(self, role: str, size: int, tp: int, sp: bool) -> "Kernel":
        """This kernel on one of ``tp`` ranks for a node of ``role`` (``size``: the features a
        column/row linear splits)."""
        if tp > 1 and self.experts and self.ffn and all(int(n) % tp == 0 for n in self.tp_sizes):
            # the experts' FFN dim split over tp (gate | up column, down row parallel): every
            # tp rank runs all its rows (replicated; all-gathered under sp) on F / tp features
            dims = list(self.dims)
            i = next((i for i in (1, 2, 3) if i != self.rows_at and dims[i] == self.ffn), None)
            if i is None:
                return replace(self, flops=self.flops / tp, bytes=self.bytes / tp)
            dims[i] = dims[i] / tp
            return replace(self, flops=self.flops / tp, dims=tuple(dims), bytes=_grouped_bytes(*dims))
        if tp == 1 or role == "replicated" or (role == "seq" and not sp):
            return self
        if self.experts:   # experts tp cannot split stay whole under tp: rows split (sp) only
            dims = list(self.dims)
            dims[self.rows_at] = dims[self.rows_at] / tp
            return replace(self, flops=self.flops / tp, dims=tuple(dims), bytes=_grouped_bytes(*dims))
        if role in ("column", "row") and self.kind == "mm":
            dims = list(self.dims)
            for i in (2, 3, 1):  # n, k, then m: the first that is the split features
                if dims[i] == size:
                    dims[i] = size / tp
                    break
            else:
                return replace(self, flops=self.flops / tp, bytes=self.bytes / tp)
            return replace(self, flops=self.flops / tp, bytes=self.bytes / tp, dims=tuple(dims))
        if self.kind == "attn" or (self.kind == "mm" and self.dims[0] > 1):
            # heads split over tp: attention calls and batched matmuls over batch x heads
            return replace(self, flops=self.flops / tp, bytes=self.bytes / tp,
                           dims=(self.dims[0] / tp,) + tuple(self.dims[1:]))
        if self.kind == "view":
            return self
        return replace(self, flops=self.flops / tp, bytes=self.bytes / tp)


def _grouped_bytes(b, m, n, k) -> float:
    """fp32 bytes of a batched (b, m, n, k) matmul: both operands and the result."""
    return 4.0 * b * (m * k + k * n + m * n)


def grouped_mm(experts: int, rows: float, n: int, k: int, ffn: float = 0.0,
               tp_sizes: tuple = ()) -> tuple[Kernel, tuple]:
    """A grouped matmul (rows sorted by expert) x (experts, k, n) weights -> (rows, n), with
    rows / experts per expert (balanced routing), and its backward: the input gradient and
    the weight gradient (``weight_grad``). All marked ``experts`` for :meth:`Kernel.regrouped`;
    ``ffn`` (n or k: the FFN dim) and ``tp_sizes`` for :meth:`Kernel.sharded`'s tp split."""
    m = rows / experts
    dims = (experts, m, n, k)
    tag = dict(experts=experts, ffn=float(ffn), tp_sizes=tuple(tp_sizes))
    f = Kernel("mm", 2.0 * rows * n * k, _grouped_bytes(*dims), dims, **tag)
    dgrad = Kernel("mm", f.flops, f.bytes, (experts, m, k, n), False, True, **tag)
    wgrad = Kernel("mm", f.flops, f.bytes, (experts, n, k, m), True, True, rows_at=3, **tag)
    return f, (dgrad, wgrad)


def _nbytes(t) -> float:
    return float(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0.0


def storage(t) -> int:
    """An id of ``t``'s storage (views share it; FakeTensors have one too)."""
    return t.untyped_storage()._cdata


def _tensors(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def mm_dims(func, args) -> tuple:
    """(batch, m, n, k) of a matmul op's arguments."""
    packet = func.overloadpacket
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    if a.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return (1, a.shape[0], b.shape[1], a.shape[1])


def is_attention(func) -> bool:
    name = func.overloadpacket.__name__
    return "attention" in name and "scaled_dot_product" in name or name.startswith(
        ("_flash_attention", "_efficient_attention", "_cudnn_attention"))


class OpRecorder(TorchDispatchMode):
    """Records every dispatched op as a :class:`Kernel` (``kernels``). In backward, a matmul
    none of whose operands is a weight (storages in ``weights``) while the node has weights is
    the weight gradient (grad_output^T x input), the other the input gradient (x weight)."""

    def __init__(self, backward: bool = False, weights: frozenset = frozenset()):
        super().__init__()
        self.kernels: list[Kernel] = []
        self.backward = backward
        self.weights = weights

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "prim" and func.overloadpacket not in _FREE:
            self.kernels.append(self.kernel(func, args, kwargs, out))
        return out

    def kernel(self, func, args, kwargs, out) -> Kernel:
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        bw = self.backward
        if func.overloadpacket in _MM:
            dims = tuple(int(x) for x in mm_dims(func, args))
            flops = 2.0 * dims[0] * dims[1] * dims[2] * dims[3]
            wg = bw and bool(self.weights) and not any(storage(t) in self.weights for t in ins)
            return Kernel("mm", flops, moved, dims, wg, bw)
        if is_attention(func):
            return _attention_kernel(func, ins, moved, bw)
        if func.is_view or func.overloadpacket in _ALIASES:
            return Kernel("view", backward=bw)
        return Kernel("elem", 0.0, moved, backward=bw)


def _attention_kernel(func, ins, moved, backward: bool) -> Kernel:
    name = func.overloadpacket.__name__
    is_bwd = "backward" in name
    q, k, v = (ins[1], ins[2], ins[3]) if is_bwd else (ins[0], ins[1], ins[2])
    if name.startswith("_flash_attention"):  # (b, s, h, d) layout
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    qs, ks, vs = (tuple(int(x) for x in t.shape) for t in (q, k, v))
    flops = (sdpa_backward_flop_count(qs, qs, ks, vs) if is_bwd else sdpa_flop_count(qs, ks, vs))
    dims = (qs[0] * qs[1], qs[2], ks[2], qs[3])
    return Kernel("attn", float(flops), moved, dims, False, backward or is_bwd)


def record(fn, inputs: list, weights=()) -> tuple[list, list]:
    """Kernels of ``fn(*inputs)`` forward, and of its backward with respect to the inputs
    that require grad (seed gradients made outside the recording); ``weights``: the inputs
    that are parameters. Run under a FakeTensorMode."""
    with OpRecorder() as fwd:
        out = fn(*inputs)
    outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    bwd = OpRecorder(True, frozenset(storage(w) for w in weights))
    if outs and wrt:
        seeds = [torch.ones_like(t) for t in outs]
        with bwd:
            torch.autograd.grad(outs, wrt, seeds, allow_unused=True)
    return fwd.kernels, bwd.kernels
