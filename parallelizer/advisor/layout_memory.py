"""Memory of the fullest rank of a layout, analytically (the search's filter; ``--exact``
compiles the layout and counts the emitted program's tensors instead, ``advisor/memory.py``).

Model states by ZeRO stage (Rajbhandari et al. 2020, §5.1: 16 bytes per parameter = e + e +
(16 - 2e) optimizer state, sharded over the dp shard group), FSDP2's gathered copies, and
Korthikanti et al. 2022 activations (``Workload.layer_activation_bytes``; divided by tp under
sequence parallelism) for the microbatches a rank holds at the peak of the schedule's own
action order (:func:`parallelizer.advisor.pipeline_sim.peak_in_flight`), plus the last
stage's fp32 logits.
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
    out = []
    for r in range(pp):
        units = [u for s, rg in enumerate(parts) if owner[s] == r for u in rg]
        blocks = [u for u in units if 0 < u < n - 1]
        ends = [u for u in units if u in (0, n - 1)]
        tied = w.tied_params if (n - 1 in units and 0 not in units) else 0.0
        out.append(RankStats(sum(w.fwd_flops[u] for u in units), sum(w.bwd_flops[u] for u in units),
                             sum(w.fwd_flops[u] for u in blocks), len(blocks),
                             sum(w.params[u] for u in blocks), sum(w.params[u] for u in ends) + tied,
                             max((w.params[u] for u in blocks), default=0.0), n - 1 in units,
                             sum(tensors[u] for u in units)))
    return out


def layout_memory(w, cluster, lay, stats, end_split) -> tuple[float, dict]:
    """Bytes on the fullest rank and its parts (module docstring)."""
    t, p, d, z, b, m, v = (lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.micro_batch,
                           lay.microbatches, lay.virtual_stages)
    e = DTYPE_BYTES[cluster.dtype]
    sp = lay.sequence_parallel and t > 1
    shards = d // (lay.dp_replicate if z >= 2 else 1)
    flight = peak_in_flight(lay.schedule, p, v, m) if p > 1 else (1,)
    best = (-1.0, {})
    for i, r in enumerate(stats):
        psi = r.block_params / t + r.end_params / end_split
        if z == 0:
            states = 16 * psi
        elif z == 1:
            states = 2 * e * psi + (16 - 2 * e) * psi / d
        else:
            states = 16 * psi / shards
        gathered = 0.0
        if z == 2 and shards > 1:
            gathered = e * psi
        elif z == 3 and shards > 1:
            gathered = e * (r.end_params / end_split + (1 + lay.prefetch) * r.max_block / t)
        # per-stage microbatches held at the peak, over this rank's stages (in block units)
        held = flight[i] / max(1, v) if p > 1 else 1
        acts = b * r.blocks * w.layer_activation_bytes(t, lay.recompute, e, sp) * held
        if lay.recompute and r.blocks:
            acts += b * w.layer_activation_bytes(t, False, e, sp)
        if r.last:
            acts += b * w.logits_bytes(t)
        total = states + gathered + acts
        if total > best[0]:
            best = (total, {"states": states, "gathered": gathered, "activations": acts, "pp_rank": i})
    return best
