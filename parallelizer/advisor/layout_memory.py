"""Memory of the fullest rank of a layout, analytically (the search's filter; ``--exact``
compiles the layout and counts the emitted program's tensors instead, ``advisor/memory.py``).

Model states by ZeRO stage (Rajbhandari et al. 2020, §5.1: 16 bytes per parameter = e + e +
(16 - 2e) optimizer state, sharded over the dp shard group), FSDP2's gathered copies, and
Korthikanti et al. 2022 activations (``Workload.layer_activation_bytes``; divided by tp under
sequence parallelism) for the microbatches a rank holds at the peak of the schedule's own
action order (:func:`parallelizer.advisor.pipeline_sim.peak_in_flight`), plus the last
stage's fp32 logits.

Mixture-of-experts layers (``Workload.moe``): at tp > 1 a layer's stacked expert weights are
split over tp along their FFN dim (1/tp per tp rank, inside DDP / FSDP2 at ep 1) when
``MoELayer.tp_split`` says the compiler splits it (``planning/experts.py`` ``plan_expert_tp``),
else whole on every tp rank (docs/expert-parallel.md, "Tensor parallelism inside the experts").
Under expert parallelism (ep > 1) a rank holds E/ep of each layer's (tp piece of the)
experts outside DDP / FSDP2, as ``parallelize estimate`` counts them (``advisor/memory.py``):
weight, gradient and AdamW state (16 bytes a parameter) 1/(ep x tp) at every ZeRO stage, never
sharded over dp nor all-gathered; ZeRO-1 partitions the optimizer over edp = dp / ep (the
ranks holding the same experts), not dp. The all-to-all buffers are the largest dispatch or
combine (send, receive and regrouped rows: 3 x b s k rows x the row's elements) at balanced
routing, the same on every tp rank (each dispatches its tp-replicated rows over its own ep
group; under sequence parallelism the MoE input is all-gathered before the router), ``runtime/expert_parallel.py``'s ``BalancedShapes``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .compute import DTYPE_BYTES
from .pipeline_sim import peak_in_flight


@dataclass(frozen=True)
class RankStats:
    """What one pp rank holds, per sequence: its units' FLOPs and parameters."""
    fwd: float
    bwd: float
    block_fwd: float       # forward FLOPs of its blocks (recomputed under checkpointing)
    blocks: int
    block_params: float    # elements in blocks (split by tp)
    end_params: float      # elements in embedding / head (split by tp when vocab-parallel)
    max_block: float       # elements of its largest block (ZeRO-3 gathers one at a time)
    last: bool             # holds the LM head (logits)
    tensors: float = 0.0   # parameter tensors
    experts: float = 0.0   # elements of its blocks' stacked expert weights (of block_params)
    max_block_experts: float = 0.0  # of max_block: its expert weights
    alltoall: float = 0.0  # elements of its largest MoE layer's dispatched rows, per sequence
    block_units: tuple = ()  # its blocks' unit indices
    max_block_unit: int = -1  # the unit of max_block (-1: no block)

    def expert_shard(self, w, tp: int) -> tuple[float, float]:
        """Elements of its blocks' expert weights on one tp rank, and of its largest block's
        (``Workload.expert_shard``: split layers 1/tp, the others whole)."""
        if tp == 1:
            return self.experts, self.max_block_experts
        shard = w.expert_shard(tp)
        return (sum(shard[u] for u in self.block_units),
                shard[self.max_block_unit] if self.max_block_unit >= 0 else 0.0)


def rank_stats(w, pp: int, virtual: int, schedule: str | None = None) -> list[RankStats]:
    """Per pp rank, from the compiler's FLOP-balanced split into pp x v stages placed as the
    schedule places them (loop, or V for zbv / dualpipev)."""
    from ..plan.schedules import stage_ranks
    from .stages import stage_units
    n = len(w.fwd_flops)
    parts = stage_units(w, pp * virtual)
    owner = (stage_ranks(schedule, pp, virtual) if schedule and len(parts) == pp * virtual
             else [s % pp for s in range(len(parts))])
    tensors = w.tensors or (0.0,) * n
    experts = w.expert_params
    rows = {}
    for layer in w.moe:
        rows[layer.unit] = max(rows.get(layer.unit, 0.0), w.seq * layer.top_k * layer.row_elems)
    out = []
    for r in range(pp):
        units = [u for s, rg in enumerate(parts) if owner[s] == r for u in rg]
        blocks = [u for u in units if 0 < u < n - 1]
        ends = [u for u in units if u in (0, n - 1)]
        tied = w.tied_params if (n - 1 in units and 0 not in units) else 0.0
        big = max(blocks, key=lambda u: w.params[u], default=None)
        out.append(RankStats(sum(w.fwd_flops[u] for u in units), sum(w.bwd_flops[u] for u in units),
                             sum(w.fwd_flops[u] for u in blocks), len(blocks),
                             sum(w.params[u] for u in blocks), sum(w.params[u] for u in ends) + tied,
                             0.0 if big is None else w.params[big], n - 1 in units,
                             sum(tensors[u] for u in units), sum(experts[u] for u in blocks),
                             0.0 if big is None else experts[big],
                             max((rows.get(u, 0.0) for u in blocks), default=0.0),
                             tuple(blocks), -1 if big is None else big))
    return out


def layout_memory(w, cluster, lay, stats, end_split) -> tuple[float, dict]:
    """Bytes on the fullest rank and its parts (module docstring)."""
    t, p, d, z, b, m, v = (lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.micro_batch,
                           lay.microbatches, lay.virtual_stages)
    e = DTYPE_BYTES[cluster.dtype]
    sp = lay.sequence_parallel and t > 1
    shards = d // (lay.dp_replicate if z >= 2 else 1)
    flight = peak_in_flight(lay.schedule, p, v, m) if p > 1 else (1,)
    ep = lay.ep
    best = (-1.0, {})
    for i, r in enumerate(stats):
        # dense parameters split by tp; expert weights 1/tp where tp splits them, 1/ep under ep
        tp_experts, tp_big_experts = r.expert_shard(w, t)
        dense = (r.block_params - r.experts) / t + r.end_params / end_split
        mine = tp_experts / ep
        psi = dense + mine
        if z == 0:
            states = 16 * psi
        elif z == 1:   # ZeroRedundancyOptimizer over dp, or over edp under ep
            group = d if ep == 1 else d // ep
            states = 2 * e * psi + (16 - 2 * e) * psi / group
        elif ep == 1:
            states = 16 * psi / shards
        else:          # experts outside FSDP2: not sharded over dp
            states = 16 * dense / shards + 16 * mine
        sharded = psi if ep == 1 else dense   # what FSDP2 gathers
        gathered = 0.0
        if z == 2 and shards > 1:
            gathered = e * sharded
        elif z == 3 and shards > 1:
            block = (r.max_block - r.max_block_experts) / t + (tp_big_experts if ep == 1 else 0.0)
            gathered = e * (r.end_params / end_split + (1 + lay.prefetch) * block)
        # per-stage microbatches held at the peak, over this rank's stages (in block units)
        held = flight[i] / max(1, v) if p > 1 else 1
        acts = b * r.blocks * w.layer_activation_bytes(t, lay.recompute, e, sp) * held
        if lay.recompute and r.blocks:
            acts += b * w.layer_activation_bytes(t, False, e, sp)
        if r.last:
            acts += b * w.logits_bytes(t)
        # every tp rank dispatches all its rows (under sp the MoE input is all-gathered first)
        alltoall = 3 * b * r.alltoall * e if ep > 1 else 0.0
        total = states + gathered + acts + alltoall
        if total > best[0]:
            parts = {"states": states, "gathered": gathered, "activations": acts}
            if ep > 1:
                parts["all-to-all"] = alltoall
            best = (total, {**parts, "pp_rank": i})
    return best
