"""One microbatch on each pipeline stage of a layout: its compute (the units' kernels on this
rank's tp shard, :mod:`parallelizer.advisor.compute`) and the tensor-parallel collectives on
its critical path.

Megatron's f and g (Shoeybi et al. 2019, §3) at every site a unit records: without sequence
parallelism f is an all-reduce in backward and g one in forward; with it (Korthikanti et al.
2022, §4.2.2) f is an all-gather in forward and a reduce-scatter in backward, g the reverse.
Under full activation checkpointing each block's forward, collectives included, runs again
in backward. A vocab-parallel loss (torch's ``loss_parallel`` / Megatron's vocab-parallel
cross-entropy) all-reduces three values per token over tp in forward (row max, target logit,
sum of exponentials).

Tensor parallelism inside the experts (docs/expert-parallel.md): a mixture-of-experts layer
whose FFN dim tp splits has its grouped matmuls on F / tp features (``Kernel.sharded``), an f
on the rows entering the experts (an all-reduce of b s k rows x hidden in backward) and a g
on their output (one in forward), all-reduces under sequence parallelism too (the MoE block
runs on the all-gathered rows): sites ``ef`` / ``eg``.

Expert parallelism (ep > 1): a mixture-of-experts layer's grouped matmuls on one ep rank
(``Kernel.regrouped``: E/ep experts, ep x the rows each, at balanced routing), and its
all-to-alls over ep on the critical path (``runtime/expert_parallel.py``): in forward the
router's per-expert counts (E int64 values: ``ep_route``), the dispatch and the combine of
the rank's b s k rows (every tp rank its own, over its own ep group); in backward the combine's and the dispatch's reverse all-to-alls;
under full activation checkpointing the forward three again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..planning.pipeline import min_max_ranges
from .collectives import Call
from .compute import Times


@dataclass
class StageCost:
    """One stage, one microbatch: compute forward / backward (``Times``), the tp calls of
    each, and what it holds; ``fwd_s`` / ``bwd_s`` / ``wgrad_s``: its seconds, calls included."""
    units: tuple
    fwd: Times
    bwd: Times
    fwd_calls: list = field(default_factory=list)
    bwd_calls: list = field(default_factory=list)
    recompute: Times = Times()
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    wgrad_s: float = 0.0

    def __post_init__(self):
        self.fwd_s = self.fwd.total + sum(c.total for c in self.fwd_calls)
        self.bwd_s = self.bwd.total + self.recompute.total + sum(c.total for c in self.bwd_calls)
        self.wgrad_s = self.bwd.weight_grad


_PARTS: dict = {}


def stage_units(w, stages: int) -> list[range]:
    """Units of each stage: the compiler's FLOP-balanced min-max split (fewer stages when
    there are fewer units); cached per unit costs."""
    n = len(w.fwd_flops)
    key = (w.fwd_flops, w.bwd_flops, w.balance, min(stages, n))
    if key not in _PARTS:
        if len(_PARTS) > 512:
            _PARTS.clear()
        costs = w.balance or [f + b for f, b in zip(w.fwd_flops, w.bwd_flops)]
        _PARTS[key] = min_max_ranges(list(costs), key[3])
    return _PARTS[key]


class StageModel:
    """Stage costs of a workload on a device, cached by (stage units, micro-batch, tp, sp)."""

    def __init__(self, w, device, comm):
        self.w, self.device, self.comm = w, device, comm
        self._units: dict = {}
        self._stages: dict = {}

    def unit(self, u: int, b: int, tp: int, sp: bool, kernels, ep: int = 1) -> tuple[Times, Times]:
        key = (id(kernels[u]), b, tp, sp, ep)
        hit = self._units.get(key)
        if hit is None:
            uk = kernels[u]
            fwd = [k.sharded(r, n, tp, sp).regrouped(ep) for r, n, k in uk.fwd]
            bwd = [k.sharded(r, n, tp, sp).regrouped(ep) for r, n, k in uk.bwd]
            hit = self._units[key] = (self.device.times(fwd, False), self.device.times(bwd, True))
        return hit

    def stage(self, units: range, b: int, tp: int, sp: bool, recompute: bool, ep: int = 1) -> StageCost:
        key = (units.start, units.stop, b, tp, sp, recompute, ep)
        hit = self._stages.get(key)
        if hit is None:
            hit = self._stages[key] = self._stage(units, b, tp, sp, recompute, ep)
        return hit

    def alltoalls(self, u: int, b: int, tp: int, sp: bool, ep: int) -> tuple[list, list]:
        """The ep all-to-alls of unit ``u``'s MoE layers for one microbatch of ``b``
        sequences: (forward calls, backward calls); none at ep 1. Bytes per call: the full
        tensor of one rank (b s k rows x the row's elements, in the compute dtype), of
        which (ep - 1) / ep leaves the rank at balanced routing."""
        if ep == 1:
            return [], []
        fwd, bwd = [], []
        for layer in self.w.moe:
            if layer.unit != u:
                continue
            # every tp rank dispatches the whole rows over its own ep group (under sp the
            # MoE input is all-gathered before the router: docs/expert-parallel.md)
            rows = b * self.w.seq * layer.top_k
            nbytes = rows * layer.row_elems * 4 * self.device.byte_scale
            call = self.comm.call("all_to_all", "ep", nbytes, ep, tp)
            fwd += [self.comm.call("all_to_all", "ep (counts)", 8.0 * layer.experts, ep, tp), call, call]
            bwd += [call, call]
        return fwd, bwd

    def _stage(self, units, b, tp, sp, recompute, ep=1) -> StageCost:
        w = self.w
        kernels = w.source.units(b)
        scale = self.device.byte_scale
        last = len(w.fwd_flops) - 1
        fwd, bwd, again = Times(), Times(), Times()
        fcalls, bcalls, rcalls = [], [], []
        for u in units:
            f, bk = self.unit(u, b, tp, sp, kernels, ep)
            fwd, bwd = fwd + f, bwd + bk
            block = 0 < u < last
            if recompute and block:
                again = again + f
            fa, ba = self.alltoalls(u, b, tp, sp, ep)
            fcalls += fa
            bcalls += ba
            if recompute and block:
                rcalls += fa
            for kind, nbytes in kernels[u].sites:
                fc, bc = self._site(kind, nbytes * scale, tp, sp)
                fcalls += fc
                bcalls += bc
                if recompute and block:
                    rcalls += fc
        if last in units and tp > 1 and w.ends_tp_sharded:
            tokens = b * w.seq
            fcalls.append(self.comm.call("all_reduce", "tp", 4.0 * tokens, tp, 1, calls=3))
        return StageCost(tuple(units), fwd, bwd, fcalls, bcalls + rcalls, again)

    def _site(self, kind: str, nbytes: float, tp: int, sp: bool) -> tuple[list, list]:
        if tp == 1:
            return [], []
        c = self.comm
        if kind in ("ef", "eg"):   # the experts' f / g: all-reduces even under sp (docs)
            ar = c.call("all_reduce", "tp", nbytes, tp)
            return ([], [ar]) if kind == "ef" else ([ar], [])
        if sp:
            ag, rs = c.call("all_gather", "tp", nbytes, tp), c.call("reduce_scatter", "tp", nbytes, tp)
            return ([ag], [rs]) if kind == "f" else ([rs], [ag])
        ar = c.call("all_reduce", "tp", nbytes, tp)
        return ([], [ar]) if kind == "f" else ([ar], [])


def merge_calls(calls: list[Call]) -> list[Call]:
    """Calls of the same (op, dim, group, bytes) summed into one entry."""
    out: dict = {}
    for c in calls:
        key = (c.op, c.dim, c.group, round(c.nbytes), round(c.seconds, 12))
        if key in out:
            prev = out[key]
            out[key] = Call(prev.op, prev.dim, prev.group, prev.calls + c.calls, prev.nbytes, prev.seconds)
        else:
            out[key] = c
    return list(out.values())
