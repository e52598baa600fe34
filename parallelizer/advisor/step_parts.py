"""The parts of :func:`parallelizer.advisor.step_time.predict`: data parallelism and the
optimizer (``dp_time``'s rules on this layout's units), the pipeline (the schedule simulated
on the stage costs), and the breakdown of the busiest rank that ``--explain`` prints and the
planner's JSON carries.

Under expert parallelism (ep > 1) the expert weights are no part of DDP's buckets nor of
FSDP2's units (``runtime/data_parallel.py``): dp reduces the dense parameters only, and the
experts' fp32 gradients are all-reduced over edp = dp / ep after the step
(``sync_expert_grads``, exposed); ZeRO-1 partitions and broadcasts over edp."""
from __future__ import annotations

from dataclasses import dataclass, field

from .collectives import Call
from .compute import DTYPE_BYTES
from .dp_time import ddp_exposed, fsdp_exposed, optimizer_seconds, overlapped_gathers
from ..plan.schedules import stage_ranks
from .pipeline_sim import StageTimes, simulate


@dataclass
class DPResult:
    exposed: float = 0.0            # seconds after the compute (reductions, ZeRO-1 broadcasts)
    optimizer: float = 0.0
    calls: list = field(default_factory=list)
    per_microbatch: list = field(default_factory=list)   # per stage: ZeRO-3 gathers in its backward
    hidden: float = 0.0             # seconds of dp communication that overlapped compute


@dataclass
class PipeResult:
    makespan: float
    bubble: float
    pp_exposed: float
    busy: tuple
    rank: int                       # the busiest pp rank
    send_calls: list = field(default_factory=list)
    runtime: float = 0.0            # the busiest rank's pipelining-runtime time per action, summed


def _local_params(model, lay, units, end_split) -> list[float]:
    """Parameter elements data parallelism reduces per unit on this rank: a block's dense
    weights split by tp, its expert weights' tp piece (1/tp where tp splits them, else whole:
    ``Workload.expert_shard``) at ep 1 and left out at ep > 1 (reduced over edp instead); the
    ends split by vocab tp."""
    w, last = model.w, len(model.w.fwd_flops) - 1
    experts, shard = w.expert_params, w.expert_shard(lay.tp)
    out = []
    for u in units:
        if 0 < u < last:
            n = (w.params[u] - experts[u]) / lay.tp + (shard[u] if lay.ep == 1 else 0.0)
        else:
            n = w.params[u] / end_split
        if u == last and 0 not in units:
            n += w.tied_params / end_split
        out.append(n)
    return out


def data_parallel(model, lay, costs, stats, end_split) -> DPResult:
    """Exposed data-parallel seconds, the optimizer, and the calls (``dp_time`` module rules)."""
    res = DPResult(per_microbatch=[0.0] * len(costs))
    e = DTYPE_BYTES[model.cluster.dtype]
    rank_units = [u for c in costs[:1] for u in c.units] if lay.pp == 1 else None
    _optimizer(model, lay, stats, end_split, res)
    if lay.dp == 1:
        return res
    if lay.pp == 1:
        units = rank_units
        per_unit = [model.stages.unit(u, lay.micro_batch, lay.tp, lay.sequence_parallel and lay.tp > 1,
                                      model.w.source.units(lay.micro_batch), lay.ep) for u in units]
        params = _local_params(model, lay, units, end_split)
        if lay.zero_stage <= 1:
            _ddp(model, lay, per_unit, params, e, res)
        else:
            _fsdp(model, lay, per_unit, params, e, res)
    else:
        _pipelined_ranks(model, lay, costs, end_split, e, res)
    group = lay.dp if lay.ep == 1 else lay.edp
    if lay.zero_stage == 1 and group > 1:
        # ZeroRedundancyOptimizer broadcasts every parameter from the rank that updated it,
        # all asynchronously, then waits: one gather's volume, its latency once; under ep
        # over edp (the ranks holding the same experts)
        bytes_ = max(_rank_params(st, lay, end_split, model.w) for st in stats) * e
        bc = model.comm.call("all_gather", "dp" if lay.ep == 1 else "edp", bytes_, group,
                             lay.tp * (1 if lay.ep == 1 else lay.ep))
        res.calls.append(bc)
        res.exposed += bc.total
    if lay.ep > 1 and lay.edp > 1:
        # sync_expert_grads: one flat all-reduce of this rank's fp32 expert gradients over
        # the edp replicas, after the backward (pp = 1) or the schedule
        mine = max(st.expert_shard(model.w, lay.tp)[0] for st in stats) / lay.ep
        ar = model.comm.call("all_reduce", "edp", mine * 4,
                             lay.edp, lay.tp * lay.ep)
        res.calls.append(ar)
        res.exposed += ar.total
    return res


def _rank_params(st, lay, end_split, w) -> float:
    """Parameter elements a pp rank holds: dense ones split by tp, E/ep of each layer's
    experts' tp piece."""
    return ((st.block_params - st.experts) / lay.tp + st.end_params / end_split
            + st.expert_shard(w, lay.tp)[0] / lay.ep)


def _optimizer(model, lay, stats, end_split, res) -> None:
    z, d = lay.zero_stage, lay.dp
    shards = d // (lay.dp_replicate if z >= 2 else 1)
    group = d if lay.ep == 1 else lay.edp   # ZeRO-1's partition: dp, or edp under ep
    worst = 0.0
    for st in stats:
        params = _rank_params(st, lay, end_split, model.w)
        if z == 0:
            mine = params
        elif z == 1:
            mine = params / group
        elif lay.ep == 1:
            mine = params / shards
        else:   # experts outside FSDP2: E/ep of their tp piece on every rank
            held = st.expert_shard(model.w, lay.tp)[0] / lay.ep
            mine = (params - held) / shards + held
        tensors = st.tensors / (group if z == 1 else 1)
        worst = max(worst, optimizer_seconds(model.cluster, model.device, tensors, 4 * mine,
                                             lay.optimizer, dtensor=z >= 2))
    res.optimizer = worst


def _ddp(model, lay, per_unit, params, e, res) -> None:
    if not lay.overlap_grad_reduce:
        ar = model.comm.call("all_reduce", "dp", sum(params) * e, lay.dp, lay.tp)
        res.calls.append(ar)
        res.exposed += ar.total
        return
    bwd = [b.total for _, b in per_unit][::-1]
    grads = [p * e for p in params][::-1]
    reduce = lambda n: model.comm.call("all_reduce", "dp", n, lay.dp, lay.tp)  # noqa: E731
    exposed, calls = ddp_exposed(bwd, grads, reduce)
    # find_unused_parameters=True (runtime/data_parallel.py): DDP all-reduces its bitmap of
    # used parameters after the backward, one int per parameter tensor
    used = model.comm.call("all_reduce", "dp (used-parameter map)", 4.0 * sum(model.w.tensors or (1,)),
                           lay.dp, lay.tp)
    res.calls += calls + [used]
    res.exposed += exposed + used.total
    res.hidden += sum(c.total for c in calls) - exposed


def _fsdp_calls(model, lay, nbytes: float) -> tuple[Call, Call, list]:
    """One unit's all-gather, reduce-scatter (+ HSDP all-reduce) calls."""
    rep = lay.dp_replicate
    shard = lay.dp // rep
    c = model.comm
    ag = c.call("all_gather", "dp", nbytes, shard, lay.tp)
    rs = c.call("reduce_scatter", "dp", nbytes, shard, lay.tp)
    extra = [c.call("all_reduce", "dp_replicate", nbytes / shard, rep, lay.tp * shard)] if rep > 1 else []
    return ag, rs, extra


def _fsdp(model, lay, per_unit, params, e, res) -> None:
    n = len(per_unit)
    root = (params[0] + params[-1]) * e
    gathers, reduces = [0.0] * n, [0.0] * n
    for i in range(n):
        nbytes = root if i == 0 else (0.0 if i == n - 1 else params[i] * e)
        if nbytes <= 0:
            continue
        ag, rs, extra = _fsdp_calls(model, lay, nbytes)
        calls = 2 if (lay.zero_stage == 3 and 0 < i < n - 1) else 1
        res.calls += [Call(ag.op, ag.dim, ag.group, calls, ag.nbytes, ag.seconds), rs] + extra
        gathers[i] = ag.seconds
        reduces[i] = rs.seconds + sum(x.seconds for x in extra)
    fwd = [f.total for f, _ in per_unit]
    bwd = [b.total for _, b in per_unit]
    exposed, _ = fsdp_exposed(fwd, bwd, gathers, reduces, lay.zero_stage == 3, lay.prefetch)
    total_comm = sum(c.total for c in res.calls if c.dim.startswith("dp"))
    res.exposed += exposed
    res.hidden += max(0.0, total_comm - exposed)


def _pipelined_ranks(model, lay, costs, end_split, e, res) -> None:
    """pp > 1 (``dp_time`` module docstring): per pp rank, its stages' reductions after the
    schedule; the step waits for the slowest rank. Per-stage results are cached."""
    owner = stage_ranks(lay.schedule, lay.pp, lay.virtual_stages)
    cache = model.__dict__.setdefault("_pipelined", {})
    worst, worst_calls = -1.0, []
    for r in range(lay.pp):
        mine = [s for s in range(len(costs)) if owner[s] == r]
        exposed, calls = 0.0, []
        if lay.zero_stage <= 1:   # one coalesced all-reduce of all this rank's gradients
            n = sum(sum(_local_params(model, lay, list(costs[s].units), end_split)) for s in mine)
            ar = model.comm.call("all_reduce", "dp", n * e, lay.dp, lay.tp)
            exposed, calls = ar.total, [ar]
        for s in (mine if lay.zero_stage >= 2 else ()):
            c = costs[s]
            key = (c.units, lay.tp, lay.dp, lay.dp_replicate, lay.zero_stage, lay.micro_batch,
                   lay.microbatches, lay.prefetch, lay.sequence_parallel, end_split, lay.ep)
            if key not in cache:
                cache[key] = _fsdp_stage(model, lay, c, _local_params(model, lay, list(c.units), end_split), e)
            x, cs, per_mb = cache[key]
            exposed += x
            calls += cs
            res.per_microbatch[s] = per_mb
        if exposed > worst:
            worst, worst_calls = exposed, calls
    res.exposed += worst
    res.calls += worst_calls


def _fsdp_stage(model, lay, cost, params, e) -> tuple:
    """One stage under FSDP2 and a pipeline schedule: (exposed seconds after the schedule:
    its reduce-scatters and first forward's gathers, calls, ZeRO-3 gathers per microbatch)."""
    per_unit = [model.stages.unit(u, lay.micro_batch, lay.tp, lay.sequence_parallel and lay.tp > 1,
                                  model.w.source.units(lay.micro_batch), lay.ep) for u in cost.units]
    gathers, calls, exposed = [], [], 0.0
    for p in params:
        ag, rs, extra = _fsdp_calls(model, lay, p * e)
        gathers.append(ag.seconds)
        calls += [rs] + extra
        exposed += rs.total + sum(x.total for x in extra)
        calls.append(Call(ag.op, ag.dim, ag.group, lay.microbatches if lay.zero_stage == 3 else 1,
                          ag.nbytes, ag.seconds))
    exposed += overlapped_gathers([f.total for f, _ in per_unit], gathers, lay.prefetch)
    per_mb = 0.0
    if lay.zero_stage == 3:
        per_mb = overlapped_gathers([b.total for _, b in per_unit][::-1], gathers[::-1], lay.prefetch)
    return exposed, calls, per_mb


def pipeline(model, lay, costs, extra, split: bool = False, uniform: bool = False) -> PipeResult:
    """The schedule's makespan on these stage costs (pp = 1: the microbatches back to back);
    with ``split`` also without the sends, to tell the bubble from what the sends add;
    ``uniform``: the search's screen (every stage as the busiest, ``pipeline_sim.simulate``)."""
    m = lay.microbatches
    if lay.pp == 1:
        c = costs[0]
        busy = m * (c.fwd_s + c.bwd_s + extra[0])
        return PipeResult(busy, 0.0, 0.0, (busy,), 0)
    # the pipelining runtime's host time per forward / backward action, where calibrated
    o = _action_s(model)
    stages = [StageTimes(c.fwd_s + o, c.bwd_s + x + o, c.wgrad_s) for c, x in zip(costs, extra)]
    nbytes = _send_bytes(model, lay)
    sc = model.comm.call("send_recv", "pp", nbytes, 2, lay.tp * lay.dp)
    if lay.p2p_blocking:  # the sender waits for its send: the stage is busy meanwhile
        last = len(stages) - 1
        sent = [StageTimes(st.fwd + (sc.seconds if i < last else 0.0), st.bwd + (sc.seconds if i else 0.0),
                           st.wgrad) for i, st in enumerate(stages)]
        with_send = simulate(lay.schedule, lay.pp, lay.virtual_stages, m, sent, 0.0, uniform)
    else:
        with_send = simulate(lay.schedule, lay.pp, lay.virtual_stages, m, stages, sc.seconds, uniform)
    without = (simulate(lay.schedule, lay.pp, lay.virtual_stages, m, stages, 0.0, uniform) if split
               else with_send)
    rank = max(range(lay.pp), key=lambda r: without.busy[r])
    sends = Call("send_recv", "pp", 2, 2 * m * lay.virtual_stages, nbytes, sc.seconds)
    mine = sum(1 for r in stage_ranks(lay.schedule, lay.pp, lay.virtual_stages) if r == rank)
    return PipeResult(with_send.makespan, without.bubble, with_send.makespan - without.makespan,
                      without.busy, rank, [sends], 2 * m * mine * o)


def _action_s(model) -> float:
    m = model.cluster.measured
    return 0.0 if m is None or m.pipeline is None else m.pipeline.action_us * 1e-6


def _send_bytes(model, lay) -> float:
    w = model.w
    cut = max(w.cut_bytes) if w.cut_bytes else 4.0 * w.seq * w.hidden
    sp = lay.sequence_parallel and lay.tp > 1
    return cut * lay.micro_batch * model.device.byte_scale / (lay.tp if sp else 1)
