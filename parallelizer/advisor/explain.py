"""``parallelize plan --explain``: one layout's step, part by part, as text (the breakdown of
:mod:`parallelizer.advisor.breakdown`), and the header line saying where the figures come
from (measured by ``parallelize calibrate`` or the datasheet) and what was assumed."""
from __future__ import annotations

from .search import TERM_NAMES


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _bytes(n: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def explain(pred, index: int = 1) -> str:
    """The breakdown of ``pred`` (a Prediction): terms adding up to the step, compute by
    kind, every collective with calls, bytes and how much of it is exposed."""
    b, step = pred.breakdown, pred.step_s
    rank = f" (pp rank {b['busiest_pp_rank']}, the busiest)" if pred.candidate.pp > 1 else ""
    lines = [f"explain #{index} {pred.candidate.short()}: step {_ms(step)}{rank}"]
    for key, seconds in b["terms"].items():
        if abs(seconds) > 1e-6 * step:
            lines.append(f"  {TERM_NAMES.get(key, key):34s} {_ms(seconds):>10s}  {seconds / step:6.1%}")
    lines.append("  compute by kind (of compute):")
    for key, seconds in b["compute"].items():
        if abs(seconds) > 1e-6 * step:
            lines.append(f"    {key:32s} {_ms(seconds):>10s}")
    if b["collectives"]:
        lines.append("  collectives (per step on this rank; exposed = on the critical path):")
    for c in b["collectives"]:
        lines.append(f"    {c['dim']:12s} {c['op']:15s} group {c['group']:<4d} {c['calls']:g} x "
                     f"{_bytes(c['bytes_per_call']):>9s} x {_ms(c['seconds_per_call']):>9s} = "
                     f"{_ms(c['total_s']):>9s}, exposed {_ms(c['exposed_s']):>9s} ({c['source']})")
    if b.get("schedule"):
        lines.append(f"  bubble: schedule {b['schedule']} simulated on torch's action lists")
    return "\n".join(lines)


def sources_line(cluster, workload) -> str:
    """What the prediction rests on: the calibration (device, date) or the datasheet, the
    attention the workload assumes, and where its heads count comes from when the model has
    no config."""
    m = cluster.measured
    if m is not None:
        src = f"measured by parallelize calibrate on {m.device} ({m.date}, {m.mode})"
    else:
        src = (f"datasheet: {cluster.gpu_name} dense peak x matmul efficiency "
               f"{cluster.matmul_efficiency:g} x tile/wave quantization; links from the cluster file")
    attention = {"flash": "fused (flash / SDPA) attention, scores neither stored nor written "
                          "(--attention eager for materialised scores)",
                 "eager": "eager attention: scores, softmax and dropout in memory (--attention eager)",
                 "graph": "attention as the model file's graph runs it"}[workload.attention]
    heads = next((f"; {n}" for n in workload.notes if n.startswith("heads: ")), "")
    return f"figures: {src}; {attention}{heads}"


REP_LEGEND = ("rep=R: HSDP, ZeRO sharding inside each of R replica groups (dp = R x dp/R: "
              "gradients reduce-scattered within a replica, then all-reduced across replicas)")
