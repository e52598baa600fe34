"""The graph partition: every node's cost-model unit (before the blocks, each block, after)
and, inside blocks that may be cut, its part (run of a direct child), with the set of
values a stage recomputes. Computed once per graph state and shared by everything that
reads that graph: the cost model and the pipeline structure read the captured graph's;
``split_stages`` reads the one of the graph the passes rewrote (they insert nodes), and
``passes/split_check.py`` checks its result against the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .graph_facts import block_of, module_path
from .recompute import Recompute


@dataclass(frozen=True)
class GraphPartition:
    """``unit_of``: node -> unit (``graph_costs.assign_units``); ``child_of``: node -> direct
    child FQN for nodes of blocks that may be cut (``assign_parts``); ``recompute``: the
    recomputable values (:class:`~parallelizer.analysis.recompute.Recompute`)."""

    blocks: tuple[str, ...]
    unit_of: dict
    child_of: dict
    recompute: Recompute

    @staticmethod
    def of(graph: fx.Graph, blocks: tuple[str, ...]) -> "GraphPartition":
        unit_of = assign_units(graph, tuple(blocks))
        return GraphPartition(tuple(blocks), unit_of, assign_parts(graph, tuple(blocks), unit_of),
                              Recompute(graph))


def blocks_in_run_order(graph: fx.Graph, blocks: tuple[str, ...]) -> tuple[str, ...]:
    """The ``blocks`` (FQNs, :func:`~parallelizer.planning.blocks.find_blocks`: registration
    order) that ``graph`` runs, in the order it first runs them. The units, the stages and
    the split read blocks in graph order: a model running its ModuleList reversed (``for l
    in reversed(self.layers)``) had every block in one stage, or a split that disagreed with
    its plan (an internal error), and a block forward never runs (a layer kept for an early
    exit) had none of the nodes the plan gave it, at every layout (zoo 17 Z2, Z3). A block
    not run is no block: its parameters are read by no stage, as any parameter the forward
    does not read."""
    run = (block_of(n, blocks) for n in graph.nodes
           if n.op in ("call_function", "call_method", "call_module"))
    return tuple(dict.fromkeys(b for b in run if b is not None))


def assign_units(graph: fx.Graph, blocks: tuple[str, ...]) -> dict:
    """node -> unit index (0 before the blocks, 1 + i for block i, len(blocks) + 1 after).

    ``PipelineDecision.stage_of_unit`` maps these units to stages, so what is costed is what
    is split. A node outside every block goes with the most recent block before it;
    placeholders are unit 0; nodes after the last block's last node form the last unit.
    """
    index = {b: i + 1 for i, b in enumerate(blocks)}
    found: dict = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "output"):
            path = module_path(node)
            found[node] = next((i for b, i in index.items() if path == b or path.startswith(b + ".")), None)
    last_block_node = max((i for i, n in enumerate(graph.nodes) if found.get(n)), default=-1)
    out, current = {}, 0
    for i, node in enumerate(graph.nodes):
        if node not in found:
            continue
        if node.op == "placeholder":
            out[node] = 0
            continue
        if found[node]:
            current = max(current, found[node])
        out[node] = current if found[node] or i < last_block_node else len(blocks) + 1
    return out


def assign_parts(graph: fx.Graph, blocks: tuple[str, ...], unit_of: dict = None) -> dict:
    """node -> the FQN of its block's direct child whose run it belongs to, for the nodes of
    block units (``assign_units``) of blocks that may be cut inside.

    A block may be cut inside when its nodes (in graph order) go through two or more direct
    children, each in one contiguous run. Nodes with the block's own path (residual adds)
    and nodes after the block outside every block go with the most recent child, those
    before the first child with the first child, as ``assign_units`` places nodes outside
    blocks with the most recent block. ``split_stages`` and the cost model both use this.
    """
    unit_of = assign_units(graph, blocks) if unit_of is None else unit_of
    current, order, child = {}, {}, {}
    for node in graph.nodes:
        u = unit_of.get(node)
        if u is None or not 1 <= u <= len(blocks):
            continue
        block = blocks[u - 1]
        path = module_path(node)
        if path.startswith(block + "."):
            current[u] = block + "." + path[len(block) + 1:].split(".", 1)[0]
            seq = order.setdefault(u, [])
            if not seq or seq[-1] != current[u]:
                seq.append(current[u])
        child[node] = current.get(u)
    cuttable = {u for u, seq in order.items() if 1 < len(seq) == len(set(seq))}
    return {n: c or order[unit_of[n]][0] for n, c in child.items() if unit_of[n] in cuttable}
