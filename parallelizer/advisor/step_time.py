"""Predicted step time and memory per rank of one layout: pure arithmetic on a Workload.

Collectives use the ring α–β model (Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", §3; Patarasuk & Yuan 2009): over g ranks,
n bytes, latency α and per-GPU bandwidth β,

    all-reduce      2 (g-1) α + 2 (g-1)/g · n/β
    reduce-scatter  (g-1) α + (g-1)/g · n/β          all-gather: the same

at the bandwidth of the link the group crosses (``Cluster.link``: NVLink inside a node,
the network once the group spans nodes; mesh order (pp, dp, tp), tp innermost).

A step (Narayanan et al. 2021, §2.2 and §3.3): the bottleneck pp rank's per-microbatch time
``t_mb`` (its FLOPs at peak x efficiency, its memory-bound ops' activation traffic at HBM
bandwidth, plus the tensor-parallel all-reduces of its blocks,
2 per block forward and again backward and in recomputation, which sit on the critical
path, plus its point-to-point sends) run ``M + (p-1)/v`` times: M microbatches and the
1F1B / interleaved bubble. Data parallelism adds what it cannot hide: ZeRO-0/2 gradient
reduction overlaps the last microbatch's backward (DDP buckets, FSDP2 reduce-scatter),
ZeRO-2's one all-gather the first microbatch's forward; ZeRO-1 (``ZeroRedundancyOptimizer``)
broadcasts the updated parameters after the step; ZeRO-3 all-gathers every unit in
forward and again in backward for every microbatch, hidden behind that microbatch's
compute when prefetch >= 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..planning.pipeline import min_max_ranges
from .cluster import Cluster
from .workload import Workload

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Candidate:
    """One layout the search considers: mesh degrees, micro-batching, ZeRO stage, virtual
    stages, recomputation (a candidate, not a tp layout nor a checkpoint's placement)."""
    tp: int
    pp: int
    dp: int
    micro_batch: int                # sequences per microbatch per dp rank
    microbatches: int               # per step per dp rank
    zero_stage: int = 0
    virtual_stages: int = 1
    recompute: bool = False         # full activation checkpointing of every block
    dp_replicate: int = 1           # HSDP: dp = dp_replicate x dp_shard (ZeRO 2/3)
    prefetch: int = 1               # FSDP units all-gathered ahead (ZeRO-3)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        return "1f1b" if self.virtual_stages == 1 else "interleaved_1f1b"

    def short(self) -> str:
        extra = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        rep = f" rep={self.dp_replicate}" if self.dp_replicate > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{rep} zero={self.zero_stage} "
                f"mb={self.micro_batch}x{self.microbatches}{extra}{' ac' if self.recompute else ''}")


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    terms: dict            # seconds: compute, bubble, tp, pp, dp (exposed)
    memory_bytes: float    # the fullest rank
    memory: dict           # that rank's parts: states, gathered, activations
    tokens_per_s: float
    tflops_per_gpu: float  # FLOPs executed (recomputation included, as eq. 3 counts) / s / GPU
    mfu: float             # model FLOPs (no recomputation) / (step x GPUs x peak)
    volumes: dict = field(default_factory=dict)  # bytes each GPU sends per step, by collective

    @property
    def dominant(self) -> str:
        over = {k: v for k, v in self.terms.items() if k != "compute"}
        return max(over, key=over.get) if any(over.values()) else "compute"


def ring_allreduce(n: float, g: int, link) -> float:
    if g <= 1 or n <= 0:
        return 0.0
    return 2 * (g - 1) * link.latency_us * 1e-6 + 2 * (g - 1) / g * n / (link.bandwidth_gb_s * 1e9)


def ring_gather(n: float, g: int, link) -> float:
    """Reduce-scatter or all-gather of ``n`` bytes (the full tensor) over ``g`` ranks."""
    if g <= 1 or n <= 0:
        return 0.0
    return (g - 1) * link.latency_us * 1e-6 + (g - 1) / g * n / (link.bandwidth_gb_s * 1e9)


def send(n: float, link) -> float:
    return link.latency_us * 1e-6 + n / (link.bandwidth_gb_s * 1e9)


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


def rank_stats(w: Workload, pp: int, virtual: int) -> list[RankStats]:
    """Per pp rank (stage s on rank s % pp), from a FLOP-balanced split into pp x v stages
    (the compiler's min-max partitioner over the units; fewer stages when there are fewer
    units)."""
    n = len(w.fwd_flops)
    parts = min_max_ranges([f + b for f, b in zip(w.fwd_flops, w.bwd_flops)], min(pp * virtual, n))
    out = []
    for r in range(pp):
        units = [u for s, rg in enumerate(parts) if s % pp == r for u in rg]
        blocks = [u for u in units if 0 < u < n - 1]
        ends = [u for u in units if u in (0, n - 1)]
        tied = w.tied_params if (n - 1 in units and 0 not in units) else 0.0
        out.append(RankStats(sum(w.fwd_flops[u] for u in units), sum(w.bwd_flops[u] for u in units),
                             sum(w.fwd_flops[u] for u in blocks), len(blocks),
                             sum(w.params[u] for u in blocks), sum(w.params[u] for u in ends) + tied,
                             max((w.params[u] for u in blocks), default=0.0), n - 1 in units))
    return out


def predict(w: Workload, cluster: Cluster, lay: Candidate, stats: list[RankStats] | None = None,
            global_batch: int | None = None) -> Prediction:
    """Step time and the fullest rank's memory of ``lay`` (see the module docstring)."""
    stats = stats or rank_stats(w, lay.pp, lay.virtual_stages)
    t, p, d, b, m, v = lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.microbatches, lay.virtual_stages
    e = DTYPE_BYTES[cluster.dtype]
    rate = cluster.peak_flops * cluster.achieved_efficiency
    end_split = t if w.ends_tp_sharded else 1
    act_msg = b * w.seq * w.hidden * e
    tp_link, pp_link = cluster.link(t, 1), cluster.link(p, t * d)
    ar = ring_allreduce(act_msg, t, tp_link)
    per_mb = []
    for r in stats:
        comp = b * (r.fwd + r.bwd + (r.block_fwd if lay.recompute else 0)) / (t * rate)
        comp += b * _activation_traffic(w, r, t, lay.recompute, e) / cluster.hbm_bytes_per_s
        tp_s = r.blocks * w.tp_allreduces_per_block * (3 if lay.recompute else 2) * ar
        pp_s = 2 * v * send(act_msg, pp_link) if p > 1 else 0.0
        per_mb.append((comp + tp_s + pp_s, comp, tp_s, pp_s, b * r.fwd / (t * rate), b * r.bwd / (t * rate)))
    t_mb, comp, tp_s, pp_s, fwd_s, bwd_s = max(per_mb)
    bubble = (p - 1) / v * t_mb
    params = max(r.block_params / t + r.end_params / end_split for r in stats)
    dp_s = _data_parallel(w, cluster, lay, params * e, fwd_s, bwd_s, stats, end_split)
    terms = {"compute": m * comp, "bubble": bubble, "tp": m * tp_s, "pp": m * pp_s, "dp": dp_s}
    step = m * t_mb + bubble + dp_s
    mem, parts = _memory(w, cluster, lay, stats, end_split)
    sequences = global_batch or b * m * d
    world = lay.world
    return Prediction(lay, step, terms, mem, parts, sequences * w.seq / step,
                      w.model_flops(sequences, lay.recompute) / (step * world) / 1e12,
                      w.model_flops(sequences, False) / (step * world * cluster.peak_flops),
                      volumes(w, lay, stats, params * e, act_msg))


def volumes(w: Workload, lay: Candidate, stats, grad_bytes: float, act_msg: float) -> dict:
    """Bytes one GPU sends per step in each collective (ring: an all-reduce of n bytes over
    g ranks sends 2 (g-1)/g n per rank, a reduce-scatter or all-gather (g-1)/g n)."""
    t, p, d, z, m = lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.microbatches
    blocks = max(r.blocks for r in stats)
    out = {"tp all-reduce": m * blocks * w.tp_allreduces_per_block * (3 if lay.recompute else 2)
           * 2 * (t - 1) / t * act_msg,
           "pp send": m * 2 * lay.virtual_stages * act_msg if p > 1 else 0.0}
    shard = d // (lay.dp_replicate if z >= 2 else 1)
    one = (shard - 1) / shard * grad_bytes if shard > 1 else 0.0
    if z <= 1:
        out["dp all-reduce"] = 2 * (d - 1) / d * grad_bytes
        out["dp all-gather"] = (d - 1) / d * grad_bytes if z == 1 else 0.0
    else:
        rep = lay.dp_replicate
        out["dp reduce-scatter"] = one
        out["dp all-gather"] = one * (1 if z == 2 else 2 * m)
        out["dp all-reduce"] = 2 * (rep - 1) / rep * grad_bytes / shard if rep > 1 else 0.0
    return {k: v for k, v in out.items() if v}


def _activation_traffic(w: Workload, r: RankStats, tp: int, recompute: bool, e: int) -> float:
    """Bytes the memory-bound ops (norms, softmax, GeLU, residual adds, the loss) move per
    sequence: each saved activation written in forward, read and its gradient written in
    backward (3x Korthikanti's saved bytes; 4x under recomputation), at HBM bandwidth and
    not overlapped with the matmuls. This is why small hidden sizes reach less of the peak:
    these bytes grow with s h and a s^2, the matmul FLOPs with s h^2."""
    per_layer = w.layer_activation_bytes(tp, False, e) * (4 if recompute else 3)
    return r.blocks * per_layer + (3 * w.logits_bytes(tp) if r.last else 0.0)


def _data_parallel(w, cluster, lay: Candidate, grad_bytes, fwd_s, bwd_s, stats, end_split) -> float:
    """Exposed data-parallel communication of one step (seconds)."""
    t, d, z = lay.tp, lay.dp, lay.zero_stage
    if d == 1:
        return 0.0
    rep = lay.dp_replicate if z >= 2 else 1
    shard = d // rep
    shard_link, rep_link, full = cluster.link(shard, t), cluster.link(rep, t * shard), cluster.link(d, t)
    if z >= 2:
        reduce = ring_gather(grad_bytes, shard, shard_link) + ring_allreduce(grad_bytes / shard, rep, rep_link)
        gather = ring_gather(grad_bytes, shard, shard_link)
    else:
        reduce, gather = ring_allreduce(grad_bytes, d, full), ring_gather(grad_bytes, d, full)
    if z >= 2:  # FSDP2 issues one collective per unit (each block, plus the root)
        units = max(r.blocks for r in stats) + 1
        lat = (units - 1) * (shard - 1) * shard_link.latency_us * 1e-6
        reduce, gather = reduce + lat, gather + lat
    exposed = max(0.0, reduce - bwd_s)
    if z == 1:
        exposed += gather
    elif z == 2:
        exposed += max(0.0, gather - fwd_s)
    elif z == 3:
        per_mb = 2 * gather
        exposed += lay.microbatches * (max(0.0, per_mb - fwd_s - bwd_s) if lay.prefetch else per_mb)
    return exposed


def _memory(w: Workload, cluster: Cluster, lay: Candidate, stats, end_split) -> tuple[float, dict]:
    """Bytes on the fullest rank: model states by ZeRO stage (Rajbhandari et al. 2020, §5.1:
    16 bytes per parameter = e + e + (16 - 2e) optimizer, sharded over the dp shard group),
    FSDP's gathered copies, and Korthikanti activations for the microbatches in flight
    (1F1B: min(p - r, M) on pp rank r; interleaved x (1 + (p-1)/(p v)), their §4.2.3)."""
    t, p, d, z, b, m, v = (lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.micro_batch,
                           lay.microbatches, lay.virtual_stages)
    e = DTYPE_BYTES[cluster.dtype]
    shards = d // (lay.dp_replicate if z >= 2 else 1)
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
        flight = 1 if p == 1 else min(p - i, m)
        if v > 1 and p > 1:
            flight *= 1 + (p - 1) / (p * v)
        acts = b * r.blocks * w.layer_activation_bytes(t, lay.recompute, e) * flight
        if lay.recompute and r.blocks:
            acts += b * w.layer_activation_bytes(t, False, e)
        if r.last:
            acts += b * w.logits_bytes(t)
        total = states + gathered + acts
        if total > best[0]:
            best = (total, {"states": states, "gathered": gathered, "activations": acts, "pp_rank": i})
    return best
