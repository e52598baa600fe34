"""Tensor-parallel planner: which linears are column_parallel and which row_parallel.

Reads the graph, never changes it (the tensor_parallel pass applies the decision).
Seed: a linear whose output reaches another linear's input through ops that keep a shard
(elementwise, gating, view, attention over heads) is the column half of a Megatron pair and
the reached linear its row half (Megatron-LM §3: MLP A|B column then row; attention q/k/v
column over heads, output projection row). Then sharding propagation checks the whole
graph; a pair group whose shard reaches an op with no rule is kept replicated, with the
reason in the report. Divisibility of every sharded size by tp is checked last.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..errors import PlanError
from ..passes.graph_facts import aten, linear_nodes
from ..passes.sharding import Propagation, propagate

_STOP = {aten.embedding.default, aten.native_layer_norm.default, aten.layer_norm.default}
_WALK_LIMIT = 400


@dataclass
class TPDecision:
    """Column/row weight FQNs (get_attr targets), the shape-constant rewrites and the
    report. ``biases`` maps a linear weight FQN to its bias FQN."""

    column: set = field(default_factory=set)
    row: set = field(default_factory=set)
    biases: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # also printed by the CLI


def plan_tp(graph: fx.Graph, tp: int) -> TPDecision:
    """Decide the Megatron column/row pairs for ``graph`` at tp degree ``tp``.

    Raises:
        PlanError: tp does not divide a sharded size (heads, kv heads, features); the
            message names ``mesh.tp``, the module and the tp degrees that would work.
    """
    decision = TPDecision()
    linears = linear_nodes(graph)
    for n in linears:
        if len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            decision.biases[n.args[1].target] = n.args[2].target
    if tp == 1:
        return decision
    pairs = _seed_pairs(linears)
    column = {c for c, rows in pairs.items() if rows}
    row = {r for rows in pairs.values() for r in rows}
    while True:
        prop = propagate(graph, column, row, tp)
        if not prop.conflicts:
            break
        bad = _component(pairs, prop.conflicts[0][2] or column)
        node, module, _g, reason = prop.conflicts[0]
        decision.report.append(f"kept replicated: {', '.join(sorted(bad))} "
                               f"(at {node} in {module or 'the root module'}: {reason})")
        column -= bad
        row -= bad
    _check_divisible(prop, tp)
    decision.column, decision.row, decision.rewrites = column, row, prop.rewrites
    decision.report.insert(0, f"column_parallel: {len(column)} linears; row_parallel: "
                              f"{len(row)} linears; replicated: "
                              f"{len(linears) - len(column) - len(row)} linears")
    if not column:
        decision.warnings.append(
            f"mesh.tp={tp} but no linear layer could be sharded (only aten.linear on a 2-D "
            f"weight is recognised; e.g. GPT-2's Conv1D/addmm is not yet): every rank holds "
            f"the whole model; see report.md")
    paired = {w for c, rows in pairs.items() if rows for w in {c} | rows}
    for n in linears:
        w = n.args[1].target
        if w not in paired:
            decision.report.append(f"replicated linear: {w} (no column/row pair found)")
    return decision


def _seed_pairs(linears: list) -> dict:
    """column weight FQN -> row weight FQNs its output reaches as their input."""
    pairs, taken = {}, set()
    is_linear = {n: n.args[1].target for n in linears}
    for lin in linears:
        w = is_linear[lin]
        if w in taken:
            pairs[w] = set()
            continue
        reached = _walk(lin, is_linear)
        pairs[w] = reached
        taken |= reached
    return pairs


def _walk(start: fx.Node, is_linear: dict) -> set:
    seen, frontier, reached = {start}, [start], set()
    while frontier and len(seen) < _WALK_LIMIT:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user in is_linear:
                if user.args[0] is node:
                    reached.add(is_linear[user])
                continue
            if user.target not in _STOP:
                frontier.append(user)
    return reached


def _component(pairs: dict, seeds) -> set:
    """All column and row FQNs linked to ``seeds`` through shared pairs."""
    comp, changed = set(seeds), True
    while changed:
        changed = False
        for c, rows in pairs.items():
            if rows and (c in comp or rows & comp) and not ({c} | rows) <= comp:
                comp |= {c} | rows
                changed = True
    return comp


def _divisors(n: int) -> set:
    return {d for d in range(1, n + 1) if n % d == 0}


def _check_divisible(prop: Propagation, tp: int) -> None:
    bad = [c for c in prop.constraints if c.size % tp]
    if not bad:
        return
    bad.sort(key=lambda c: c.what != "heads")
    c = bad[0]
    valid = set.intersection(*[_divisors(x.size) for x in prop.constraints])
    raise PlanError(
        f"mesh.tp ({tp}) must divide the number of {c.what} ({c.size}) of {c.module or 'the model'} "
        f"({c.detail}); valid choices: tp in {{{', '.join(map(str, sorted(valid)))}}}")
