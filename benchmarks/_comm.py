"""Record every collective a step issues the way torch's ``CommDebugMode`` does: a
``TorchDispatchMode`` that sees each ``c10d`` / ``_c10d_functional`` op dispatched, whoever
calls it (FSDP2, DTensor, ``torch.distributed.pipelining``, our runtime). Not
CommDebugMode itself: its module tracker raises under ``torch.distributed.pipelining``
(``IndexError`` in ``_fw_set_module_hook``, torch 2.13), and it keeps neither the process
group nor the bytes of a call, nor point-to-point ``send``."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

_PG = torch._C._distributed_c10d.ProcessGroup
# schema argument names of the buffers an op reads / writes
_OUT_ARGS = {"output_tensor", "output_tensors", "outputs", "output_lists", "output"}
_IN_ARGS = {"tensors", "input_tensor", "input_tensors", "inputs", "input_list", "input"}
_SKIP = {"barrier", "recv_", "recv_any_source_", "monitored_barrier_", "wait_tensor"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _dtype(x):
    if isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return None


def buffer_bytes(op: str, in_bytes: int, out_bytes: int) -> int:
    """The collective's buffer, as the papers size it: the full (gathered) tensor for an
    all-gather, the full input for a reduce-scatter, the tensor itself otherwise."""
    if "allgather" in op:
        return out_bytes
    return in_bytes


def wire_bytes(op: str, buffer: int, n: int) -> float:
    """Bytes one rank sends for a collective of ``buffer`` bytes over ``n`` ranks with the ring
    algorithms (Patarasuk & Yuan 2009; Megatron-LM §3 cites them): all-reduce 2(n-1)/n,
    all-gather and reduce-scatter (n-1)/n, a send its buffer. An all-to-all's buffer is what
    leaves the rank already (the recorder subtracts the rows it addresses to itself: see
    :func:`all_to_all_wire_bytes`)."""
    if n <= 1:
        return 0.0
    if "allreduce" in op:
        return 2 * (n - 1) / n * buffer
    if "allgather" in op or "reduce_scatter" in op:
        return (n - 1) / n * buffer
    return float(buffer)


def all_to_all_wire_bytes(input: torch.Tensor, input_split_sizes, me: int, n: int) -> int:
    """Bytes one rank sends in an all-to-all of ``input`` over ``n`` ranks, ``me`` its place in
    the group: everything but the rows addressed to itself, which never leave it (the ring
    convention's "sent": a ring all-reduce's 2(n-1)/n leaves out the rank's own chunk too).
    ``input_split_sizes``: rows per destination, empty for equal splits (c10d's rule)."""
    total = _nbytes(input)
    if n <= 1:
        return 0
    if not input_split_sizes:
        return total - total // n
    row = total // input.shape[0] if input.shape[0] else 0
    return total - int(input_split_sizes[me]) * row


# c10d: what torch.distributed calls (FSDP2, pipelining, our runtime); _c10d_functional:
# functional collectives (DTensor, hence torch's tensor parallelism), under c10d's names
_CANONICAL = {"all_reduce": "allreduce_", "all_reduce_": "allreduce_",
              "all_reduce_coalesced": "allreduce_coalesced_",
              "all_gather_into_tensor": "_allgather_base_",
              "all_gather_into_tensor_coalesced": "allgather_into_tensor_coalesced_",
              "reduce_scatter_tensor": "_reduce_scatter_base_",
              "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced_",
              "broadcast": "broadcast_", "all_to_all_single": "alltoall_base_"}


_FUNCTIONAL = set(_CANONICAL)


def _canonical(op: str) -> str:
    """One name per collective, whichever API issued it (functional or c10d)."""
    return _CANONICAL.get(op, op)


class CollectiveRecorder(TorchDispatchMode):
    """``with CollectiveRecorder() as rec: step()``; then ``rec.records``: one dict per c10d
    call on this rank: op, ranks of its process group, dtype, buffer bytes (receives are
    left out: their bytes are counted at the sender)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []
        self._in_funcol = 0
        self._saved = None

    # A collective issued inside a tensor subclass's op (DTensor's loss_parallel: the max,
    # sum of exponentials and target logit all-reduced inside cross-entropy) runs while this
    # mode is off, so the functional all_reduce DTensor calls is wrapped as well, counted once.
    def __enter__(self):
        import torch.distributed._functional_collectives as funcol
        orig = funcol.all_reduce

        def all_reduce(t, reduceOp, group, tag=""):
            self._in_funcol += 1
            try:
                out = orig(t, reduceOp, group, tag)
            finally:
                self._in_funcol -= 1
            pg = _resolve_process_group(funcol._resolve_group_name(group, tag))
            self._add("allreduce_", dist.get_process_group_ranks(pg), t, _nbytes(t), 0)
            return out

        self._saved = (funcol, orig)
        funcol.all_reduce = all_reduce
        return super().__enter__()

    def __exit__(self, *exc):
        funcol, orig = self._saved
        funcol.all_reduce = orig
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = getattr(func, "namespace", None), getattr(func, "_overloadpacket", func).__name__
        if (ns == "c10d" and name not in _SKIP) or (
                ns == "_c10d_functional" and name in _FUNCTIONAL and not self._in_funcol):
            self._record(func, args)
        return func(*args, **(kwargs or {}))

    def _record(self, func, args) -> None:
        op = _canonical(func._overloadpacket.__name__)
        named = dict(zip((a.name for a in func._schema.arguments), args))
        if "group_name" not in named and "process_group" not in named:
            raise RuntimeError(f"CollectiveRecorder: {func} has no process group argument: {named}")
        if "group_name" in named:
            pg = _resolve_process_group(named["group_name"])
        else:
            pg = _PG.unbox(named["process_group"])
        ranks = dist.get_process_group_ranks(pg)
        ins = [v for k, v in named.items() if k in _IN_ARGS]
        outs = [v for k, v in named.items() if k in _OUT_ARGS]
        in_bytes, out_bytes = _nbytes(ins), _nbytes(outs)
        if "group_size" in named and "gather" in op:  # functional: the output is not an argument
            out_bytes = in_bytes * named["group_size"]
        wire = None
        if op == "alltoall_base_":  # rows to itself stay on the rank
            wire = all_to_all_wire_bytes(named["input"], named["input_split_sizes"],
                                         ranks.index(dist.get_rank()), len(ranks))
        self._add(op, ranks, ins or outs, in_bytes, out_bytes, wire)

    def _add(self, op: str, ranks: list, tensors, in_bytes: int, out_bytes: int, wire=None) -> None:
        buf = buffer_bytes(op, in_bytes, out_bytes)
        if wire is None:
            wire = wire_bytes(op, buf, len(ranks) if op != "send" else 2)
        self.records.append({"op": op, "ranks": ranks, "dtype": _dtype(tensors), "bytes": buf,
                             "wire_bytes": wire, "rank": dist.get_rank()})
