"""Gradient planner: where the backward of tensor parallelism needs more than Megatron's f
before the column linears and g after the row ones (Shoeybi et al. 2019, §3).

Reads the captured graph and a TPDecision, never changes them; the tensor_parallel pass
applies the f edges, the plan sums the Partial parameters (``plan.grad_sync`` kind
``partial_tp``, runtime/step.py). The placements come from :func:`derive`
(analysis/gradients.py: the dual of sharding propagation, its rules in the docstring):

- a replicated activation entering sharded compute (other than a column linear's input)
  gets an ``f`` on that edge, one per producer: its gradient is then summed over tp in
  backward, as the column linears' inputs are;
- a replicated parameter whose gradient is Partial (a per-head q/k norm weight on
  head-sharded values: Qwen3's ``q_norm``; a replicated bias added to a sharded value) has
  its gradient summed over the tp ranks once per step, after backward;
- a parameter whose gradient would be Mixed (read whole by some ops and by sharded compute
  by others) gets an f on the edges into sharded compute instead, so its gradient is whole.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.gradient_forward import PlannedForward
from ..analysis.gradients import MIXED, PARTIAL, derive
from ..errors import PlanError
from ..plan.decisions import TPDecision


def plan_gradients(graph: fx.Graph, decision: TPDecision) -> None:
    """Fill ``decision.f_edges`` and ``decision.partial`` (and their report lines).

    Raises:
        PlanError: a parameter's gradient stays Mixed (an internal error: every such read
            gets an f, so this names a rule that is missing).
    """
    fwd = PlannedForward(graph, decision)
    forced: set = set()
    flow = derive(graph, fwd)
    for _ in range(len(graph.nodes)):
        new = _edges_into_sharded(flow, fwd) - forced
        if not new:
            break
        forced |= new
        flow = derive(graph, fwd, forced=frozenset(forced))
    mixed = flow.mixed_params()
    if mixed:
        fqn, c = sorted(mixed.items())[0]
        raise PlanError(f"internal error (a bug in parallelizer, please report it): the gradient "
                        f"of {fqn} under tensor parallelism is neither whole nor Partial at "
                        f"{flow.where(c.origin)} ({c.why}); compile with mesh.tp=1 meanwhile")
    decision.f_edges = flow.f_edges
    decision.partial = dict(sorted(flow.partial_params().items()))
    for fqn, where in decision.partial.items():
        decision.report.append(f"gradient summed over tp once per step (Partial: each rank "
                               f"sees its shard's contribution): {fqn} (read by {where})")
    for producer, readers in flow.f_edges.items():
        decision.report.append(f"f (copy_to_tp_region) on a replicated activation entering "
                               f"sharded compute: {producer} -> {', '.join(readers)} "
                               f"({flow.where(readers[0])})")


def _edges_into_sharded(flow, fwd) -> set:
    """(input, reader) edges at the sharded-compute nodes that made a parameter's gradient
    Mixed: the replicated inputs there, which an f then makes whole."""
    out = set()
    for c in flow.mixed_params().values():
        node = flow.nodes.get(c.origin)
        own = flow.values.get(c.origin)
        if node is not None and own is not None and own.kind == PARTIAL \
                and any(fwd.role(node, a) in ("split", "gather", "whole")
                        for a in node.all_input_nodes):
            # a Partial gradient met an op computed whole (a redistribution): the f goes
            # where that gradient became Partial, the sharded compute reading the whole value
            node = flow.nodes.get(own.origin)
        if c.kind == MIXED and node is not None:
            out |= {(a.name, node.name) for a in node.all_input_nodes
                    if not fwd.varying_input(node, a)}
    return out
