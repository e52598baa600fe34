"""Which random stream each dropout of the captured graph draws from (Megatron-LM, Shoeybi
et al. 2019, §3: "dropout ... in the model parallel regions" draws per-rank masks, the rest
the same mask on every tp rank; Korthikanti et al. 2022, §4.2, likewise for the
sequence-parallel regions).

Reads the graph and the sharding placements of the tp planner, never changes the graph; the
``rng_streams`` pass (``passes/dropout.py``) applies the decision, the emitted program's
``runtime/rng.py`` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.graph_facts import module_path, source_line
from ..analysis.sharding.placements import is_replicated
from ..errors import PlanError
from ..plan.parallel_plan import DROPOUT_OPS, REPLICATED, TP_LOCAL


@dataclass(frozen=True)
class DropoutSite:
    """One dropout: graph node name, the module that called it (FQN, "" at the root), the
    ATen op, its probability (None when not a constant) and the stream it draws from."""
    node: str
    module: str
    op: str
    p: float | None
    stream: str


def plan_dropout(graph: fx.Graph, placements: dict) -> tuple[DropoutSite, ...]:
    """Every dropout node of ``graph`` that draws (p > 0 or not a constant, train not False)
    with its stream: ``tp`` when its input (the query of an SDPA) is sharded over tp
    (``placements``: node name -> placement, from sharding propagation; empty at tp = 1),
    else ``replicated``."""
    sites = []
    for node in graph.nodes:
        op = str(node.target) if node.op == "call_function" else ""
        if op not in DROPOUT_OPS or not _draws(node, op):
            continue
        x = node.args[0]
        sharded = isinstance(x, fx.Node) and not is_replicated(placements.get(x.name))
        p = _probability(node, op)
        sites.append(DropoutSite(node.name, _module(node), op,
                                 float(p) if isinstance(p, (int, float)) else None,
                                 TP_LOCAL if sharded else REPLICATED))
    return tuple(sites)


def check_random_ops(graph: fx.Graph, tp: int) -> None:
    """Refuse, at tp > 1, a random op of ``graph`` that is not a dropout (ATen's
    ``nondeterministic_seeded`` tag outside :data:`DROPOUT_OPS`: the ``torch.rand`` of a
    stochastic-depth drop path, a ``bernoulli``, a ``randn`` noise). The program would draw
    it from each rank's default generator, with no stream keeping the tp replicas of a
    replicated value equal (they drift apart) and nothing turning it off under --verify, so
    the emitted program would be wrong; at tp = 1 it draws in eager's order.

    Raises:
        PlanError: names the op, the module FQN and the model's source line, and the fix.
    """
    if tp == 1:
        return
    for node in graph.nodes:
        target = node.target
        if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or str(target) in DROPOUT_OPS
                or torch.Tag.nondeterministic_seeded not in target.tags):
            continue
        where = source_line(node)
        raise PlanError(
            f"mesh.tp={tp}: {target} ({node.name}) in {module_path(node) or 'the root module'}"
            f"{f' at {where}' if where else ''} draws random numbers outside a dropout (a "
            f"stochastic-depth drop path, noise): tensor parallelism gives such a draw no "
            f"random stream (the tp ranks' copies would drift apart) and --verify cannot turn "
            f"it off. Make it inactive in build_model (a drop_path_rate / stochastic depth of "
            f"0 in the config) or compile with mesh.tp=1")


def _probability(node: fx.Node, op: str):
    pos, kw = DROPOUT_OPS[op]
    if kw in node.kwargs:
        return node.kwargs[kw]
    return node.args[pos] if len(node.args) > pos else 0.0


def _draws(node: fx.Node, op: str) -> bool:
    p = _probability(node, op)
    if isinstance(p, (int, float)) and p == 0:
        return False
    if op == "aten.scaled_dot_product_attention.default":
        return True
    train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
    return train is not False


def _module(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else ""


def describe(sites) -> list[str]:
    """report.md lines: one per stream, naming the modules (first few) and probabilities."""
    lines = []
    for stream in (REPLICATED, TP_LOCAL):
        mine = [s for s in sites if s.stream == stream]
        if not mine:
            continue
        names = [f"{s.module or s.node} (p={'?' if s.p is None else f'{s.p:g}'})" for s in mine]
        more = f", ... ({len(names) - 6} more)" if len(names) > 6 else ""
        what = ("same mask on every tp rank" if stream == REPLICATED
                else "each tp rank its own mask (sharded over tp)")
        lines.append(f"{stream} stream, {what}: {len(mine)} site(s): {', '.join(names[:6])}{more}")
    return lines
