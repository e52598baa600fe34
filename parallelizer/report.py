"""report.md: what the compiler decided and why, for a human."""
from __future__ import annotations

from .plan import ParallelPlan

_DP = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 per block, kept after forward",
       3: "FSDP2 per block, resharded after forward"}
from .planning.pipeline import PipelineDecision


def render_report(plan: ParallelPlan, route: str, tp_lines, pp: PipelineDecision, notes) -> str:
    m = plan.mesh
    lines = [f"# parallelizer report", "",
             f"- mesh: pp={m['pp']} x dp={m['dp']} x tp={m['tp']} = {plan.world_size} ranks "
             f"(order pp, dp, tp; tp innermost)",
             f"- capture: {route}",
             f"- schedule: {plan.schedule}, microbatches: {plan.microbatches}; "
             f"data parallel: {_DP[plan.zero_stage]} over dp (zero_stage {plan.zero_stage})",
             "", "## Tensor parallel", ""]
    lines += [f"- {line}" for line in tp_lines] or ["- tp=1: nothing sharded"]
    sharded = [t for t in plan.tensors.values() if t.tp_dim is not None]
    lines += ["", "| tensor | shape | placement | role |", "|---|---|---|---|"]
    for t in sharded:
        lines.append(f"| {t.fqn} | {list(t.shape)} | Shard({t.tp_dim}) | {t.role} |")
    lines += ["", "## Pipeline stages", "",
              "| stage | blocks | parameters | sends |", "|---|---|---|---|"]
    for st, params in zip(plan.stages, pp.stage_params):
        blocks = f"{st.blocks[0]} .. {st.blocks[-1]}" if st.blocks else "-"
        lines.append(f"| {st.index} | {blocks} | {params:,} | {', '.join(st.outputs) or 'outputs'} |")
    tied = [t.fqn for t in plan.tensors.values() if len(t.stages) > 1]
    if tied:
        lines += ["", f"Tied across stages (gradients summed between them): {', '.join(tied)}"]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
