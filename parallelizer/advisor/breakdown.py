"""The busiest rank's step, part by part: what ``parallelize plan --explain`` prints and the
planner's JSON carries (``Prediction.breakdown``).

``terms`` add up to the step (seconds): ``compute`` (kernels, recomputation included),
``tp`` (tensor-parallel collectives, on the critical path), ``ep`` (expert-parallel
all-to-alls: each MoE layer's dispatch and combine, forward and backward, on the critical
path), ``bubble`` (the schedule's idle
time on the busiest rank), ``pp`` (what the point-to-point sends add to the critical path),
``dp`` (data-parallel communication the compute does not hide), ``optimizer``, ``other``
(the loss's 0-dim all-reduces, tied-weight gradient sums). ``compute`` splits into matmul,
attention, memory-bound ops and host overhead (per-op dispatch); ``collectives`` lists every
collective with its calls, bytes, seconds and how much of it is exposed.
"""
from __future__ import annotations

from ..plan.schedules import stage_ranks
from .compute import Times
from .measured import moved_fraction
from .stages import merge_calls

OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
            "all_to_all": "all-to-all", "send_recv": "send"}


def rank_breakdown(model, lay, costs, pipe, dp, other) -> dict:
    m = lay.microbatches
    owner = stage_ranks(lay.schedule, lay.pp, lay.virtual_stages) if lay.pp > 1 else (0,) * len(costs)
    mine = [s for s in range(len(costs)) if owner[s] == pipe.rank]
    times, recompute, tp_calls = Times(), Times(), []
    for s in mine:
        c = costs[s]
        times = times + c.fwd + c.bwd
        recompute = recompute + c.recompute
        tp_calls += [_times(x, m) for x in c.fwd_calls + c.bwd_calls]
    tp_calls = merge_calls(tp_calls)
    extra = m * sum(dp.per_microbatch[s] for s in mine)
    ep_calls = [c for c in tp_calls if c.dim.startswith("ep")]
    terms = {"compute": m * (times.total + recompute.total),
             "tp": sum(c.total for c in tp_calls if not c.dim.startswith("ep")),
             "ep": sum(c.total for c in ep_calls),
             "bubble": pipe.bubble, "pp": pipe.pp_exposed, "pp_runtime": pipe.runtime,
             "dp": dp.exposed + extra, "optimizer": dp.optimizer,
             "other": sum(c.total for c in other)}
    collectives = ([_row(c, c.total, model) for c in tp_calls]
                   + [_row(c, pipe.pp_exposed, model) for c in pipe.send_calls]
                   + _dp_rows(dp, extra, model) + [_row(c, c.total, model) for c in other])
    all_ = times + recompute
    compute = {"matmul": m * all_.matmul, "attention": m * all_.attention,
               "memory-bound": m * all_.memory, "host overhead": m * all_.host,
               "recompute (of the above)": m * recompute.total}
    if model.device.serial is False:
        compute["overlap"] = m * (all_.total - all_.matmul - all_.attention - all_.memory - all_.host)
    return {"terms": terms, "compute": compute, "collectives": collectives,
            "volumes": _volumes(tp_calls, pipe, dp, lay),
            "busiest_pp_rank": pipe.rank, "sources": _sources(model),
            "schedule": lay.schedule if lay.pp > 1 else None}


def _times(c, m):
    from .collectives import Call
    return Call(c.op, c.dim, c.group, c.calls * m, c.nbytes, c.seconds)


def _row(c, exposed, model) -> dict:
    return {"op": OP_NAMES.get(c.op, c.op), "dim": c.dim, "group": c.group, "calls": c.calls,
            "bytes_per_call": c.nbytes, "seconds_per_call": c.seconds, "total_s": c.total,
            "exposed_s": exposed, "source": model.comm.source(c.op, c.group)}


def _dp_rows(dp, extra, model) -> list:
    calls = merge_calls(dp.calls)
    total = sum(c.total for c in calls) or 1.0
    exposed = dp.exposed + extra
    return [_row(c, exposed * c.total / total, model) for c in calls]


def _volumes(tp_calls, pipe, dp, lay) -> dict:
    out: dict = {}
    for c in tp_calls + merge_calls(dp.calls):
        key = f"{c.dim.split(' ')[0].replace('dp_replicate', 'dp')} {OP_NAMES.get(c.op, c.op)}"
        out[key] = out.get(key, 0.0) + c.calls * moved_fraction(c.op, c.group) * c.nbytes
    for c in pipe.send_calls:
        out["pp send"] = out.get("pp send", 0.0) + c.calls * c.nbytes
    return {k: v for k, v in out.items() if v}


def _sources(model) -> dict:
    m = model.cluster.measured
    return {"compute": model.device.source,
            "collectives": "measured" if m is not None and m.collectives else "cluster links",
            "calibrated": None if m is None else f"{m.date}, {m.device}"}
