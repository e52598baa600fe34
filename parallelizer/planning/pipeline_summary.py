"""What a pipeline split costs, as data for report.md and ``parallelize inspect``.

Per stage: forward/backward FLOPs, parameter bytes and the activation bytes it sends
(cost model, ``analysis/costs.py``); imbalance = max / mean stage FLOPs; the theoretical
bubble of the schedule. Also the compile-time checks of a split: every parameter lands in
the stages the partition predicts, and microbatches against pp.
"""
from __future__ import annotations

from typing import Optional

from ..errors import PlanError
from ..analysis.costs import PipelineCosts
from ..plan.decisions import PipelineDecision
from ..plan.schedules import bubble
from .pipeline import repeated_calls

def stage_units(decision: PipelineDecision, costs: PipelineCosts) -> list[tuple]:
    """(stage, UnitCost, bytes crossing the cut after it) of each cost-model unit in
    execution order, a block cut across stages replaced by its parts."""
    out = [(decision.stage_of_unit(0), costs.units[0], costs.cut_bytes[0] if len(costs.cut_bytes) else 0)]
    for b in range(len(decision.blocks)):
        after = costs.cut_bytes[b + 1]
        runs = costs.parts[b] if b < len(costs.parts) else ()
        if runs and decision.is_cut(b + 1):
            inner = costs.part_cut_bytes[b]
            out += [(decision.stage_of_unit(b + 1, u.name), u, inner[j] if j < len(inner) else after)
                    for j, u in enumerate(runs)]
        else:
            out.append((decision.stage_of_unit(b + 1), costs.units[b + 1], after))
    out.append((decision.stage_of_unit(len(decision.blocks) + 1), costs.units[-1], 0))
    return out


def summarize(decision: PipelineDecision, costs: PipelineCosts, schedule: str, pp: int,
              microbatches: int, virtual_stages: int = 1) -> dict:
    """JSON-ready summary: ``{"stages": [{"index", "blocks", "children", "fwd_flops",
    "bwd_flops", "flops", "param_bytes", "activation_bytes_sent", "fqns"}], "imbalance",
    "bubble", ...}``; ``children``: block FQN -> the direct children the stage holds, for
    blocks cut across stages.

    FLOPs are per training step of the example batch ``batch_shape``; activation bytes are
    what the stage sends forward for that batch (its gradient comes back in backward).
    """
    units = stage_units(decision, costs)
    stages = []
    for s in range(decision.num_stages):
        mine = [(u, sent) for st, u, sent in units if st == s]
        fqns = list(dict.fromkeys(f for u, _ in mine for f in u.params))
        stages.append({
            "index": s,
            "blocks": [decision.blocks[i] for i in decision.block_range(s)],
            "children": decision.children(s),
            "fwd_flops": sum(u.fwd_flops for u, _ in mine),
            "bwd_flops": sum(u.bwd_flops for u, _ in mine),
            "flops": sum(u.flops for u, _ in mine),
            "param_bytes": sum(costs.param_bytes[f] for f in fqns),
            "activation_bytes_sent": mine[-1][1] if s < decision.num_stages - 1 and mine else 0,
            "fqns": fqns,
        })
    flops = [st["flops"] for st in stages]
    mean = sum(flops) / len(flops)
    return {
        "stages": stages,
        "imbalance": max(flops) / mean if mean else 1.0,
        "bubble": bubble(schedule, pp, microbatches, virtual_stages),
        "schedule": schedule, "pp": pp, "microbatches": microbatches,
        "virtual_stages": virtual_stages, "split": decision.source,
        "batch_shape": list(costs.batch_shape), "notes": list(costs.notes),
    }


# max / mean stage FLOPs above which a split of blocks that forward runs several times is
# warned of: whole blocks run once each balance to within one block's share
UNBALANCED = 1.25


def repeated_calls_warning(summary: dict, blocks, calls) -> list[str]:
    """A warning when blocks that forward runs more than once (labml's HyperLSTM calls each
    cell of its ModuleList once per time step) leave the stages unbalanced: stages are cut
    where forward first enters a block, so every later call of an earlier block runs on the
    stage after the cut, which the cost model's per-block FLOPs do not see (the zoo's
    HyperLSTM at pp2: 6 % / 94 %, reported as the balanced split)."""
    repeated = repeated_calls(blocks, calls)
    stages = summary["stages"]
    if len(stages) < 2 or not repeated or summary["imbalance"] < UNBALANCED:
        return []
    gflop = ", ".join(f"{st['flops'] / 1e9:.3g}" for st in stages)
    return [f"the pipeline stages are unbalanced (max / mean stage FLOPs "
            f"{summary['imbalance']:.2f}; GFLOP per stage: {gflop}): forward runs "
            f"{', '.join(repeated[:3])}{' ...' if len(repeated) > 3 else ''} with the same "
            f"weights, and stages are cut where forward first enters a block, so the later "
            f"calls of a block run on the stage after the cut (a loop over time steps around "
            f"the blocks, an RNN's cells); a step runs at the speed of the largest stage: use "
            f"mesh.pp=1, or one module per layer, each run once"]


def check_placement(summary: dict, stage_fqns: list, params: set, canonical: dict) -> list[str]:
    """Check (not assume) that the split graphs hold what the partition planned.

    Args:
        summary: from :func:`summarize` (the partition's parameter FQNs per stage).
        stage_fqns: FQNs each split stage graph actually reads (``ParallelPlan.stages``).
        params: every parameter name of the model (tied aliases included).
        canonical: alias -> canonical FQN.

    Returns:
        warnings: parameters that no stage holds (unused in forward).

    Raises:
        PlanError: a stage holds a parameter the partition did not put there, or misses
            one it did (a split bug, never the user's): names stage and FQN.
    """
    for st, actual in zip(summary["stages"], stage_fqns):
        want = set(st["fqns"])
        got = {f for f in actual if canonical.get(f, f) in {canonical.get(p, p) for p in params}}
        if want != got:
            extra, missing = sorted(got - want), sorted(want - got)
            raise PlanError(f"pipeline stage {st['index']} holds {extra or 'nothing extra'} it was not "
                            f"assigned and lacks {missing or 'nothing'}; this is a parallelizer bug "
                            f"in the stage split, please report it with the model")
    placed = {canonical.get(f, f) for st in summary["stages"] for f in st["fqns"]}
    unused = sorted({canonical.get(p, p) for p in params} - placed)
    if unused:
        return [f"{len(unused)} parameter(s) are not used by forward and are in no pipeline stage "
                f"(no gradient, not in the checkpoint): {', '.join(unused[:5])}"
                f"{' ...' if len(unused) > 5 else ''}"]
    return []


def check_microbatches(pp: int, microbatches: int, schedule: str,
                       virtual_stages: int = 1) -> list[str]:
    """Raises PlanError when microbatches < pp; returns a warning when < 2 pp (bubble > 33 %)."""
    if pp <= 1:
        return []
    if microbatches < pp:
        raise PlanError(f"pipeline.microbatches ({microbatches}) must be >= mesh.pp ({pp}): with "
                        f"fewer microbatches than stages some stage never has work; set "
                        f"pipeline.microbatches={pp} or more (>= {2 * pp} keeps the bubble under 33%)")
    if microbatches < 2 * pp:
        b = bubble(schedule, pp, microbatches, virtual_stages)
        return [f"pipeline.microbatches ({microbatches}) < 2 x mesh.pp = {2 * pp}: the pipeline bubble "
                f"is {b:.0%} of the step ({schedule}); more microbatches shrink it "
                f"({2 * pp} gives {bubble(schedule, pp, 2 * pp, virtual_stages):.0%})"]
    return []


def virtual_stages_of(spec_pipeline) -> int:
    """``pipeline.virtual_stages`` when the spec has it (interleaved schedules), else 1."""
    v: Optional[int] = getattr(spec_pipeline, "virtual_stages", None)
    return int(v) if v else 1
