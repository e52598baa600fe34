"""Tensor-parallel ranks in one process, for tests: forward, backward and an SGD step of a
tp-rewritten GraphModule, each rank in its own thread holding only its pieces of the sharded
parameters (cut by the checkpoint writer's ``local_piece`` from the planner's dims and
layouts). Megatron's ``f`` and ``g`` (Shoeybi et al. 2019, §3) keep their autograd meaning:
``g`` sums the ranks' partial outputs in forward, ``f`` sums the ranks' input gradients in
backward; the sum is taken over a barrier, in rank order, so every rank gets the same bits.
The only thing replaced is the transport (``dist.all_reduce`` -> a sum between threads).
Replicated kv heads (whole tensors, or the copied parts of a fused q|k|v) then sum their
gradients over the ranks holding one head, and parameters whose gradient is Partial over tp
(``TPDecision.partial``) over all ranks, as ``runtime/step.py`` does. The vocab_parallel
operators run the runtime's own local lookup and gather (runtime/vocab.py) with the
transport swapped likewise. Random ops (runtime/rng.py) draw from each rank's own streams
when given (:class:`RankStreams`).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.fx as fx

from parallelizer.checkpoint.slicing import local_piece
from parallelizer.plan.layouts import ReplicatedHeads, copied_heads, copied_runs
from parallelizer.plan.parallel_plan import TensorPlan
from parallelizer.runtime import rng, sequence as sp
from parallelizer.runtime.tp import (copy_to_tp_region, gather_from_tp_dim, reduce_from_tp_region,
                                     reduce_partial_from_tp, scatter_copies_to_tp_region,
                                     scatter_pieces_to_tp_region, scatter_to_tp_region)
from parallelizer.runtime.vocab import (GatherLastDim, gather_from_tp_region, local_lookup,
                                        vocab_parallel_lookup)
from parallelizer.runtime.vocab_loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy


class _AllReduce:
    def __init__(self, tp: int):
        self.tp, self.slots = tp, [None] * tp
        self.barrier = threading.Barrier(tp, timeout=120)

    def __call__(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = t.detach()
        self.barrier.wait()
        total = self.slots[0].clone()
        for s in self.slots[1:]:
            total += s
        self.barrier.wait()
        return total

    def reduce(self, rank: int, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` summed (``op`` "sum") or maxed ("max") over the ranks, into ``t``."""
        parts = self.gather(rank, t)
        t.copy_(torch.stack(parts).amax(0) if op == "max" else sum(parts[1:], parts[0].clone()))
        return t

    def gather(self, rank: int, t: torch.Tensor) -> list:
        """Every rank's ``t``, in rank order (the all-gather of ``gather_from_tp_region``)."""
        self.slots[rank] = t.detach()
        self.barrier.wait()
        parts = [s.clone() for s in self.slots]
        self.barrier.wait()
        return parts


class _RankComm:
    """runtime/sequence.py's transport for one simulated rank: the ranks' tensors meet in
    ``shared`` (an _AllReduce's slots and barrier) and are concatenated or summed in rank order."""

    def __init__(self, shared: _AllReduce, rank: int):
        self.shared, self._rank = shared, rank

    def size(self) -> int:
        return self.shared.tp

    def rank(self) -> int:
        return self._rank

    def _exchange(self, t):
        sh = self.shared
        sh.slots[self._rank] = t.detach()
        sh.barrier.wait()
        got = list(sh.slots)
        sh.barrier.wait()
        return got

    def all_gather(self, t):
        return torch.cat(self._exchange(t), 0)

    def reduce_scatter(self, t):
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.chunk(self.shared.tp, 0)[self._rank].clone()


_SEQUENCE_OPS = {sp.reduce_scatter_to_sequence_parallel_region: sp.ReduceScatter,
                 sp.all_gather_from_sequence_parallel_region: sp.AllGather,
                 sp.split_to_sequence_parallel_region: sp.Split,
                 sp.gather_from_sequence_parallel_region: sp.Gather}


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, rank):
        ctx.comm, ctx.rank = comm, rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm(ctx.rank, grad.contiguous()), None, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, rank):
        return comm(rank, x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Scatter(torch.autograd.Function):
    """The rank's block along ``dim``; backward: the blocks of all ranks' gradients placed
    side by side (an all-gather, as a sum of zero-padded blocks)."""

    @staticmethod
    def forward(ctx, x, dim, comm, rank):
        ctx.dim, ctx.comm, ctx.rank, ctx.n = dim, comm, rank, x.shape[dim]
        k = x.shape[dim] // comm.tp
        return x.narrow(dim, rank * k, k).clone()

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.n
        full = grad.new_zeros(shape)
        k = grad.shape[ctx.dim]
        full.narrow(ctx.dim, ctx.rank * k, k).copy_(grad)
        return ctx.comm(ctx.rank, full), None, None, None


class _ScatterCopies(torch.autograd.Function):
    """runtime/tp.py scatter_copies_to_tp_region over threads: the rank's copy of entry
    ``rank // (tp / n)``; backward: the copies' gradients summed into their entries (a sum of
    zero-padded entries)."""

    @staticmethod
    def forward(ctx, x, dim, comm, rank):
        ctx.dim, ctx.comm, ctx.rank, ctx.n = dim, comm, rank, x.shape[dim]
        ctx.entry = rank // (comm.tp // ctx.n)
        return x.narrow(dim, ctx.entry, 1).clone()

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.n
        full = grad.new_zeros(shape)
        full.narrow(ctx.dim, ctx.entry, 1).copy_(grad)
        return ctx.comm(ctx.rank, full), None, None, None


class _ScatterPieces(torch.autograd.Function):
    """runtime/tp.py scatter_pieces_to_tp_region over threads: the rank's ranges ``runs[rank]``
    side by side; backward: each rank's gradient added into its ranges (a sum of zero-padded
    pieces; copies of one range sum their shares)."""

    @staticmethod
    def forward(ctx, x, dim, runs, comm, rank):
        ctx.dim, ctx.runs, ctx.comm, ctx.rank, ctx.shape = dim, runs[rank], comm, rank, x.shape
        return torch.cat([x.narrow(dim, at, n) for at, n in ctx.runs], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        full, at_piece = grad.new_zeros(ctx.shape), 0
        for at, n in ctx.runs:
            full.narrow(ctx.dim, at, n).copy_(grad.narrow(ctx.dim, at_piece, n))
            at_piece += n
        return ctx.comm(ctx.rank, full), None, None, None, None


class _GatherDim(torch.autograd.Function):
    """runtime/tp.py gather_from_tp_dim over threads: the ranks' blocks side by side (along
    the inner factor of a merged dim when ``inner``); backward: the rank's block."""

    @staticmethod
    def forward(ctx, x, dim, inner, comm, rank):
        ctx.dim, ctx.rank, ctx.n, ctx.inner, ctx.tp = dim, rank, x.shape[dim], inner, comm.tp
        if not inner:
            return torch.cat(comm.gather(rank, x.contiguous()), dim=dim)
        parts = comm.gather(rank, x.unflatten(dim, (-1, inner // comm.tp)).contiguous())
        return torch.cat(parts, dim=dim + 1).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.inner:
            return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n).contiguous(), *[None] * 4
        block = ctx.inner // ctx.tp
        mine = grad.unflatten(ctx.dim, (-1, ctx.inner)).narrow(ctx.dim + 1, ctx.rank * block, block)
        return mine.flatten(ctx.dim, ctx.dim + 1).contiguous(), *[None] * 4


class _ReducePartial(torch.autograd.Function):
    """runtime/tp.py reduce_partial_from_tp over threads ("sum" or "avg")."""

    @staticmethod
    def forward(ctx, x, op, comm, rank):
        ctx.scale = 1.0 / comm.tp if op == "avg" else 1.0
        return comm(rank, x.contiguous()) * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None


class RankStreams:
    """Each simulated rank's own random streams (runtime/rng.py), seeded as ``init`` seeds
    tp rank r of (pp 0, dp 0) from ``seed``: the replicated stream is ``seed`` on every rank,
    as after ``torch.manual_seed(seed)`` in eager. rng's streams are process globals, so a
    rank's draw runs under a lock with its own streams swapped in."""

    _lock = threading.Lock()

    def __init__(self, seed: int, tp: int):
        self.states = [(rng.stream_seeds(seed, 0, 0, r, tp), {}) for r in range(tp)]

    @contextlib.contextmanager
    def of(self, rank: int):
        with self._lock:
            saved = dict(rng._seeds), dict(rng._generators)
            seeds, gens = self.states[rank]
            rng._seeds.clear(), rng._seeds.update(seeds)
            rng._generators.clear(), rng._generators.update(gens)
            try:
                yield
            finally:
                gens.clear(), gens.update(rng._generators)
                rng._seeds.clear(), rng._seeds.update(saved[0])
                rng._generators.clear(), rng._generators.update(saved[1])


_RANDOM = {rng.random_op, sp.random_op_on_tp_shard, sp.random_op_on_sequence_shard}


class _Rank(fx.Interpreter):
    def __init__(self, gm, rank, comm, leaves, streams=None):
        super().__init__(gm)
        self.rank, self.comm, self.leaves, self.streams = rank, comm, leaves, streams

    def call_function(self, target, args, kwargs):
        if target in _RANDOM and self.streams is not None:
            with self.streams.of(self.rank):
                return self._call(target, args, kwargs)
        return self._call(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        return self.leaves.get(target, None) if target in self.leaves else \
            super().get_attr(target, args, kwargs)

    def _call(self, target, args, kwargs):
        if target is copy_to_tp_region:
            return _F.apply(args[0], self.comm, self.rank)
        if target is reduce_from_tp_region:
            return _G.apply(args[0], self.comm, self.rank)
        if target in _SEQUENCE_OPS:  # the runtime's own operators, over threads
            x, dim, seq = (list(args) + [None])[:3]
            return _SEQUENCE_OPS[target].apply(x, dim, seq, _RankComm(self.comm, self.rank))
        if target is sp.gathered_linears:
            shard, dim, seq, kinds, *params = args
            return sp.gathered_linears_over(_RankComm(self.comm, self.rank), shard, dim, seq,
                                            kinds, *params)
        if target in (sp.random_op_on_sequence_shard, sp.random_op_on_tp_shard):
            return target(*args, comm=_RankComm(self.comm, self.rank), **kwargs)
        if target is scatter_to_tp_region:
            return _Scatter.apply(args[0], args[1], self.comm, self.rank)
        if target is scatter_copies_to_tp_region:
            return _ScatterCopies.apply(args[0], args[1], self.comm, self.rank)
        if target is scatter_pieces_to_tp_region:
            return _ScatterPieces.apply(*args, self.comm, self.rank)
        if target is gather_from_tp_dim:
            return _GatherDim.apply(args[0], args[1], (list(args) + [0])[2], self.comm, self.rank)
        if target is reduce_partial_from_tp:
            return _ReducePartial.apply(args[0], args[1], self.comm, self.rank)
        if target is vocab_parallel_lookup:  # the runtime's lookup at this rank
            return local_lookup(*args, self.rank)
        if target is vocab_parallel_cross_entropy:
            logits, t, vocab, reduction, ignore = args
            return VocabParallelCrossEntropy.apply(
                logits.reshape(-1, logits.shape[-1]), t, vocab, ignore, reduction, self.rank,
                lambda x, op: self.comm.reduce(self.rank, x, op))
        if target is gather_from_tp_region:
            return GatherLastDim.apply(args[0], args[1], self.rank,
                                       lambda t: self.comm.gather(self.rank, t))
        return super().call_function(target, args, kwargs)


@dataclass
class RankResult:
    outputs: list        # flat outputs of the graph
    params: dict         # get_attr target -> local leaf after the SGD step
    grads: dict          # get_attr target -> local gradient (kv copies summed)


def _sharding(decision) -> tuple[dict, dict]:
    """(tp_dim, layout) by tensor of a TPDecision, or of a (TPDecision, VocabDecision) pair
    (vocab_parallel's entries first, as the plan reads them: planning/tensors.py)."""
    if isinstance(decision, tuple):
        tp, vocab = decision
        return {**tp.dims, **vocab.dims}, {**tp.layouts, **vocab.layouts}
    return decision.dims, decision.layouts


def local(t: torch.Tensor, target: str, decision, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``t`` under the decision (the whole tensor if not sharded);
    ``decision``: a TPDecision or a (TPDecision, VocabDecision) pair."""
    dims, layouts = _sharding(decision)
    d = dims.get(target)
    if d is None:
        return t.detach().clone()
    plan = TensorPlan(target, tuple(t.shape), "float32", d, (0,), layout=layouts.get(target))
    return local_piece(t.detach(), plan, tp, rank).clone()


def forward_ranks(gm: fx.GraphModule, decision, tp: int, flat_inputs: list) -> list[list]:
    """Each rank's flat outputs of a forward of ``gm`` (no gradients)."""
    with torch.no_grad():
        return [r.outputs for r in run_ranks(gm, decision, tp, flat_inputs, None, 0.0)]


def assert_lockstep_matches(model, gm, decision, x, tp: int = 2):
    """Each simulated tp rank's first output equals the unmodified model's (1e-5)."""
    with torch.no_grad():
        ref = model(*x)
    for out in forward_ranks(gm, decision, tp, list(x)):
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


def run_ranks(gm: fx.GraphModule, decision, tp: int, flat_inputs: list, loss_of, lr: float,
              streams: RankStreams | None = None):
    """Each rank: forward, ``loss_of(outputs).backward()``, SGD step (``loss_of`` None: the
    forward only). Returns RankResults. ``decision``: as for :func:`local`. ``streams``:
    each rank's random streams (None: the process's, shared by the ranks)."""
    comm = _AllReduce(tp)
    targets = sorted({n.target for n in gm.graph.nodes if n.op == "get_attr"})
    leaves = []
    for r in range(tp):
        mine, by_id = {}, {}  # tied tensors read under two names share one leaf
        for t in targets:
            full = _attr(gm, t)
            if isinstance(full, torch.Tensor):
                if id(full) not in by_id:
                    by_id[id(full)] = local(full, t, decision, tp, r).requires_grad_(
                        full.requires_grad)
                mine[t] = by_id[id(full)]
        leaves.append(mine)
    results, errors = [None] * tp, []

    def work(r):
        try:
            outs = _Rank(gm, r, comm, leaves[r], streams).run(*flat_inputs)
            if loss_of is not None:
                loss_of(outs).backward()
            results[r] = outs
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            comm.barrier.abort()
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    _sum_replicated_head_grads(leaves, decision, tp)
    _sum_partial_grads(leaves, decision, tp)
    out = []
    for r in range(tp):
        grads = {t: p.grad for t, p in leaves[r].items() if p.requires_grad}
        with torch.no_grad():
            stepped = {t: (p - lr * p.grad if p.grad is not None else p.detach())
                       for t, p in leaves[r].items()}
        out.append(RankResult(list(results[r]), stepped, grads))
    return out


def _attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _sum_replicated_head_grads(leaves, decision, tp):
    """Sum the gradients of copied kv heads (a replicated_heads tensor, or the copied parts
    of a fused one) over the ranks holding the same head."""
    dims, layouts = _sharding(decision)
    for target, layout in layouts.items():
        if not copied_heads(layout) or target not in leaves[0]:
            continue
        d = dims[target]
        for offset, length, heads in copied_runs(_full_length(layout), layout, tp):
            copies = tp // heads
            for head in range(heads):
                group = [leaves[r][target].grad.narrow(d, offset, length)
                         for r in range(head * copies, (head + 1) * copies)]
                total = sum(g.clone() for g in group)
                for g in group:
                    g.copy_(total)


def _sum_partial_grads(leaves, decision, tp):
    """Sum the gradients of replicated parameters that are Partial over tp (the decision's
    ``partial``: plan.grad_sync ``partial_tp``) over the ranks, as runtime/step.py does."""
    tp_decision = decision[0] if isinstance(decision, tuple) else decision
    for target in getattr(tp_decision, "partial", {}):
        grads = [leaves[r][target].grad for r in range(tp)
                 if target in leaves[r] and leaves[r][target].grad is not None]
        if len(grads) == tp:
            total = sum(g.clone() for g in grads)
            for g in grads:
                g.copy_(total)


def _full_length(layout) -> int:
    if isinstance(layout, ReplicatedHeads):
        return layout.heads * layout.head_dim
    return sum(layout.parts)
