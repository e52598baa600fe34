"""Predicted step time and memory of one layout: arithmetic on a Workload's kernels.

A step (Narayanan et al. 2021, §2.2 and §3.3), as the emitted program runs it:

1. every pipeline stage's microbatch: its units' kernels on this rank's tp shard
   (:mod:`~parallelizer.advisor.compute`: the calibration's measured throughput by shape,
   else the datasheet) and the Megatron f/g collectives of its tp sites, all-reduces or,
   under sequence parallelism, all-gathers and reduce-scatters (:mod:`~.stages`); under full
   activation checkpointing each block's forward again in backward;
2. the schedule run on torch's own action lists for it (:mod:`~.pipeline_sim`): the bubble is
   what the busiest rank waits, the point-to-point sends what they add to the critical path;
3. data-parallel communication as the runtime overlaps it (:mod:`~.dp_time`), the optimizer
   step, and the loss all-reduces.

Collectives: :mod:`~.collectives` (measured α/β per op and group size, else the ring model
on the cluster's links). ``Prediction.breakdown`` holds every part; ``terms`` add up to the
step: compute, tp, ep, bubble, pp, dp, optimizer, other.

Expert parallelism (``Candidate.ep``, :mod:`~.stages`): at balanced routing (every rank
receives as many (token, expert) rows as it sends, what a router's load-balancing loss aims
at; dropless routing can receive up to ep times that) a rank's expert compute is its own
``b s k`` rows, grouped into E/ep experts of ``ep b s k / E`` rows; each MoE layer's
dispatch and combine are all-to-alls over ep in forward and again in backward (and in
recomputation), the router's counts one small all-to-all; expert gradients are all-reduced
over edp = dp / ep after the step instead of joining dp's (:mod:`~.step_parts`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import Cluster
from .collectives import ring_allreduce, ring_gather, send  # noqa: F401  (re-exported)
from .compute import DTYPE_BYTES, Device
from .collectives import Comm
from .layout_memory import RankStats, layout_memory, rank_stats  # noqa: F401  (re-exported)
from .stages import StageModel, stage_units
from .breakdown import rank_breakdown
from .step_parts import data_parallel, pipeline
from .workload import Workload


@dataclass(frozen=True)
class Candidate:
    """One layout the search considers: mesh degrees, micro-batching, ZeRO stage, virtual
    stages, recomputation, schedule (a candidate, not a tp layout nor a checkpoint's placement).
    ``dp_replicate`` (HSDP) is how many replicas of the ZeRO 2/3 shard group there are:
    dp = dp_replicate x dp_shard, sharded inside a node, replicated across nodes. ``ep``
    (expert parallelism) is carved out of dp: each mixture-of-experts layer's experts split
    over ep consecutive dp ranks, the dp / ep expert-data-parallel (edp) replicas summing
    their gradients."""
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
    schedule_name: str | None = None   # None: 1f1b, or interleaved_1f1b with virtual stages
    sequence_parallel: bool = True  # tensor_parallel.sequence_parallel (auto: on when tp > 1)
    optimizer: str = "adamw"
    # pp = 1, ZeRO 0/1: DDP's bucketed all-reduce overlaps the backward (our runtime); False:
    # one all-reduce after it (Megatron-LM's local DDP before --overlap-grad-reduce, 2023)
    overlap_grad_reduce: bool = True
    # pp > 1: sends overlap the sender's next action (torch.distributed.pipelining's isend);
    # True: the sender waits for each (Megatron-LM before --overlap-p2p-communication, 2023)
    p2p_blocking: bool = False
    ep: int = 1                     # expert-parallel degree (divides dp and every layer's experts)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        if self.schedule_name:
            return self.schedule_name
        return "1f1b" if self.virtual_stages == 1 else "interleaved_1f1b"

    def short(self) -> str:
        extra = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        if self.schedule_name and self.schedule_name not in ("1f1b", "interleaved_1f1b"):
            extra += f" {self.schedule_name}"
        rep = f" rep={self.dp_replicate}" if self.dp_replicate > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{rep}{ep} zero={self.zero_stage} "
                f"mb={self.micro_batch}x{self.microbatches}{extra}{' ac' if self.recompute else ''}")


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step. ``terms`` (seconds adding up to the step: compute, tp,
    bubble, pp, dp, optimizer, other), ``volumes`` (bytes each GPU sends per step, by
    collective) and ``breakdown`` (every part, :mod:`~.breakdown`) are worked out when first
    read: the search ranks thousands of layouts by ``step_s`` alone."""
    candidate: Candidate
    step_s: float
    memory_bytes: float    # the fullest rank
    memory: dict           # that rank's parts: states, gathered, activations
    tokens_per_s: float
    tflops_per_gpu: float  # FLOPs executed (recomputation included, as eq. 3 counts) / s / GPU
    mfu: float             # model FLOPs (no recomputation) / (step x GPUs x peak)
    detail: object = field(default=None, compare=False, repr=False)   # () -> breakdown dict
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def breakdown(self) -> dict:
        if "b" not in self._cache:
            self._cache["b"] = self.detail()
        return self._cache["b"]

    @property
    def terms(self) -> dict:
        return self.breakdown["terms"]

    @property
    def volumes(self) -> dict:
        return self.breakdown["volumes"]

    @property
    def dominant(self) -> str:
        over = {k: v for k, v in self.terms.items() if k != "compute"}
        return max(over, key=over.get) if any(over.values()) else "compute"


class StepModel:
    """What the predictions of one workload on one cluster share: device, links, caches."""

    def __init__(self, w: Workload, cluster: Cluster, dtype: str):
        self.w, self.cluster = w, cluster
        self.device = Device(cluster, dtype)
        self.comm = Comm(cluster)
        self.stages = StageModel(w, self.device, self.comm)
        self._parts: dict = {}
        self._stats: dict = {}

    def parts(self, n: int) -> list:
        if n not in self._parts:
            self._parts[n] = stage_units(self.w, n)
        return self._parts[n]

    def stats(self, pp: int, v: int, schedule: str) -> list:
        key = (pp, v, schedule)
        if key not in self._stats:
            self._stats[key] = rank_stats(self.w, pp, v, schedule)
        return self._stats[key]


_MODELS: dict = {}


def step_model(w: Workload, cluster: Cluster) -> StepModel:
    key = (id(w), id(cluster))
    hit = _MODELS.get(key)
    if hit is None or hit.w is not w or hit.cluster is not cluster:
        if len(_MODELS) > 64:
            _MODELS.clear()
        hit = _MODELS[key] = StepModel(w, cluster, cluster.dtype)
    return hit


def predict(w: Workload, cluster: Cluster, lay: Candidate, stats: list | None = None,
            global_batch: int | None = None, screen: bool = False) -> Prediction:
    """Step time, its breakdown and the fullest rank's memory of ``lay`` (module docstring).
    ``screen``: the pipeline timed with every stage as the busiest one (the search's fast
    first pass; its leaders are predicted again without it)."""
    model = step_model(w, cluster)
    stats = stats or model.stats(lay.pp, lay.virtual_stages, lay.schedule)
    end_split = lay.tp if w.ends_tp_sharded else 1
    mem, parts = layout_memory(w, cluster, lay, stats, end_split)
    return timed(model, lay, stats, end_split, mem, parts, global_batch, screen)


def memory_of(w: Workload, cluster: Cluster, lay: Candidate, stats: list | None = None) -> tuple:
    """The fullest rank's bytes and parts alone (the search filters on them before timing a
    layout; ``check`` needs nothing else)."""
    stats = stats or step_model(w, cluster).stats(lay.pp, lay.virtual_stages, lay.schedule)
    return layout_memory(w, cluster, lay, stats, lay.tp if w.ends_tp_sharded else 1)


def timed(model: StepModel, lay: Candidate, stats, end_split, mem, parts,
          global_batch: int | None, screen: bool = False) -> Prediction:
    w, cluster = model.w, model.cluster
    sp = lay.sequence_parallel and lay.tp > 1
    costs = [model.stages.stage(r, lay.micro_batch, lay.tp, sp, lay.recompute, lay.ep)
             for r in model.parts(lay.pp * lay.virtual_stages)]
    dp = data_parallel(model, lay, costs, stats, end_split)
    pipe = pipeline(model, lay, costs, dp.per_microbatch, uniform=screen)
    other = _other_calls(model, lay, stats, end_split)
    step = pipe.makespan + dp.exposed + dp.optimizer + sum(c.total for c in other)
    sequences = global_batch or lay.micro_batch * lay.microbatches * lay.dp

    def detail() -> dict:
        split = pipeline(model, lay, costs, dp.per_microbatch, split=True, uniform=screen)
        return rank_breakdown(model, lay, costs, split, dp, other)
    return Prediction(lay, step, mem, parts, sequences * w.seq / step,
                      w.model_flops(sequences, lay.recompute) / (step * lay.world) / 1e12,
                      w.model_flops(sequences, False) / (step * lay.world * cluster.peak_flops),
                      detail)


def _other_calls(model: StepModel, lay: Candidate, stats, end_split) -> list:
    """The loss's 0-dim all-reduces over pp and dp (every rank returns the global loss) and,
    under pp > 1, the sum of a tied embedding / head gradient over the two stages holding it."""
    c, out = model.comm, []
    if lay.pp > 1:
        out.append(c.call("all_reduce", "pp", 4.0, lay.pp, lay.tp * lay.dp))
        if model.w.tied_params:
            e = DTYPE_BYTES[model.cluster.dtype] if lay.zero_stage >= 2 else 4
            out.append(c.call("all_reduce", "pp (tied)", model.w.tied_params / end_split * e, 2,
                              lay.tp * lay.dp * (lay.pp - 1)))
    if lay.dp > 1:
        out.append(c.call("all_reduce", "dp", 4.0, lay.dp, lay.tp))
    return out
