"""Which pipeline stages hold each tensor: the stages of the cost-model units (or block
parts) that read it, under a :class:`~parallelizer.plan.decisions.PipelineDecision`.

The compiler plans with it before any rewrite, and ``reshard --pp`` re-partitions a
checkpoint with it from the recorded structure alone, so the two cannot disagree.
"""
from __future__ import annotations

from ..plan.decisions import PipelineDecision


def tensor_stages(decision: PipelineDecision, uses: dict, part_uses: dict) -> dict[str, tuple[int, ...]]:
    """fqn -> sorted stage indices holding it.

    Args:
        uses: fqn -> cost-model units of its readers (``ParallelPlan.structure["uses"]``).
        part_uses: fqn -> direct children (block parts) of its readers inside blocks that
            may be cut (``structure["part_uses"]``).

    A tensor read by no unit (none in the examples) is placed on stage 0.
    """
    out = {}
    for fqn, units in uses.items():
        stages = {decision.stage_of_unit(u) for u in units if not decision.is_cut(u)}
        parts = (decision.stage_of_part(c) for c in part_uses.get(fqn, ()))
        stages |= {s for s in parts if s is not None}
        out[fqn] = tuple(sorted(stages or {0}))
    return out
