"""Pipeline pictures (matplotlib, Agg backend): stage-cost bars and the schedule timeline.

The timeline is torch's own schedule, not a simulation of ours: the per-rank action lists
(``pipeline_order``) that ``torch.distributed.pipelining`` builds for the schedule class,
obtained through ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``.
Compute actions are kept (torch 2.13's spacing helper rejects REDUCE_GRAD) and placed in
time by torch's ``add_schedule_op_spacing`` (an action waits for the one it depends on on
the neighbouring rank). One slot per action: the picture shows order and idle slots, not
durations.
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

SCHEDULE_CLASSES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                    "looped_bfs": "LoopedBFS", "interleaved_zero_bubble": "InterleavedZeroBubble",
                    "zbv": "ZBVZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
                    "dualpipev": "DualPipeV"}
_KIND = {"FORWARD": ("F", "#4c72b0"), "FULL_BACKWARD": ("B", "#dd8452"),
         "BACKWARD_INPUT": ("I", "#c44e52"), "BACKWARD_WEIGHT": ("W", "#55a868"),
         "OVERLAP_F_B": ("F+B", "#8172b3")}
_IDLE = "#e6e6e6"


def schedule_timeline(schedule: str, pp: int, microbatches: int,
                      virtual_stages: int = 1) -> list[list]:
    """Per rank, per slot: ``(kind, label)`` of a compute action, or None when idle.

    ``kind`` is a ``_ComputationType`` name (FORWARD, FULL_BACKWARD, BACKWARD_INPUT,
    BACKWARD_WEIGHT, OVERLAP_F_B); ``label`` is torch's action string (``1F3``: stage 1,
    forward of microbatch 3).

    Raises:
        ValueError: torch has no schedule class of that name.
    """
    from torch.distributed.pipelining._schedule_visualizer import (add_schedule_op_spacing,
                                                                   get_schedule_ops)
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(SCHEDULE_CLASSES.get(schedule, schedule))
    single = issubclass(cls, PipelineScheduleSingle)
    with contextlib.redirect_stdout(io.StringIO()):  # the spacing helper prints every step
        ops = get_schedule_ops(cls, pp, microbatches, None if single else max(2, virtual_stages),
                               add_spacing=False)
        ops = [_from_zero([a for a in rank if a is not None and a.computation_type.name in _KIND])
               for rank in ops]
        ops = add_schedule_op_spacing(ops)
    out = []
    for rank in ops:
        row = [(a.computation_type.name, "F+B" if a.sub_actions else str(a))
               if a is not None else None for a in rank]
        while row and row[-1] is None:
            row.pop()
        out.append(row)
    return out


def _from_zero(actions: list) -> list:
    """torch 2.13's Schedule1F1B order numbers the last rank's forwards from 1 (its warmup is
    empty and the counter is bumped before the first use); renumber them from 0 so that
    the spacing helper can match each backward to its forward."""
    fwd = [a.microbatch_index for a in actions if a.computation_type.name == "FORWARD"]
    shift = min(fwd, default=0)
    if not shift:
        return actions
    return [a._replace(microbatch_index=a.microbatch_index - shift)
            if a.computation_type.name == "FORWARD" else a for a in actions]


def draw_timeline(timeline: list[list], path: Path, title: str) -> None:
    """One row per rank: coloured forward/backward slots, grey idle slots, to ``path`` (PNG)."""
    plt = _pyplot()
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    slots = max((len(r) for r in timeline), default=1)
    fig, ax = plt.subplots(figsize=(min(2 + slots * 0.32, 40), 1 + 0.5 * len(timeline)))
    small = slots <= 60
    for r, row in enumerate(timeline):
        y = len(timeline) - 1 - r
        for x in range(slots):
            act = row[x] if x < len(row) else None
            color = _KIND[act[0]][1] if act else _IDLE
            ax.add_patch(Rectangle((x, y + 0.1), 1, 0.8, facecolor=color, edgecolor="white", lw=0.5))
            if act and small:
                ax.text(x + 0.5, y + 0.5, act[1], ha="center", va="center", fontsize=5, color="white")
    ax.set_xlim(0, slots)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, len(timeline))
    ax.set_yticks([len(timeline) - 0.5 - r for r in range(len(timeline))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(timeline))])
    ax.set_xlabel("schedule slot (one action each)")
    used = {a[0] for row in timeline for a in row if a}
    handles = [Patch(color=c, label=n.lower().replace("_", " ")) for n, (_, c) in _KIND.items() if n in used]
    ax.legend(handles=handles + [Patch(color=_IDLE, label="idle")], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def draw_stage_costs(summary: dict, path: Path) -> None:
    """Bars of forward and backward FLOPs per stage, with the mean, to ``path`` (PNG)."""
    plt = _pyplot()
    stages = summary["stages"]
    idx = [s["index"] for s in stages]
    fwd = [s["fwd_flops"] / 1e9 for s in stages]
    bwd = [s["bwd_flops"] / 1e9 for s in stages]
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(idx) + 2), 3))
    ax.bar(idx, fwd, label="forward", color=_KIND["FORWARD"][1])
    ax.bar(idx, bwd, bottom=fwd, label="backward", color=_KIND["FULL_BACKWARD"][1])
    mean = sum(f + b for f, b in zip(fwd, bwd)) / len(idx)
    ax.axhline(mean, color="black", lw=0.8, ls="--", label="mean")
    ax.set_xticks(idx)
    ax.set_xlabel("stage")
    ax.set_ylabel("GFLOP per step (example batch)")
    ax.set_title(f"stage cost, imbalance {summary['imbalance']:.3f} (max / mean)", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, path)


def write_pipeline_plots(summary: dict, out_dir: Path) -> list[str]:
    """``pipeline_costs.png`` and ``pipeline_schedule.png`` in ``out_dir``; file names written.
    The timeline is skipped (returned list says so) when torch lacks the schedule."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draw_stage_costs(summary, out_dir / "pipeline_costs.png")
    written = ["pipeline_costs.png"]
    pp, m, v = summary["pp"], summary["microbatches"], summary["virtual_stages"]
    if pp > 1:
        try:
            timeline = schedule_timeline(summary["schedule"], pp, m, v)
        except ValueError:  # a schedule torch lacks is refused at compile time; never crash here
            return written
        draw_timeline(timeline, out_dir / "pipeline_schedule.png",
                      f"{summary['schedule']}: pp={pp}, microbatches={m}"
                      f"{f', virtual stages={v}' if v > 1 else ''}; theoretical bubble "
                      f"{summary['bubble']:.0%}")
        written.append("pipeline_schedule.png")
    return written


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Write atomically (temp name, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    os.replace(tmp, path)
