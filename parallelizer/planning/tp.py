"""Tensor-parallel planner: which linears are column_parallel and which row_parallel.

Reads the graph, never changes it (the tensor_parallel pass applies the decision).
Seed: a linear whose output reaches another linear's input through ops that keep a shard
(elementwise, gating, view, attention over heads) is the column half of a Megatron pair and
the reached linear its row half (Megatron-LM §3: MLP A|B column then row; attention q/k/v
column over heads, output projection row). Then sharding propagation checks the whole
graph; a pair group whose shard reaches an op with no rule is kept replicated, with the
reason in the report. Divisibility of every sharded size by tp is checked last.

Linears are ``aten.linear`` (nn.Linear, weight (out, in)) and ``aten.addmm`` on a parameter
(GPT-2's Conv1D, weight (in, out)): column_parallel shards the output-features dim of the
weight, row_parallel the input-features dim, whichever that is. Propagation also decides
each column weight's layout (:mod:`parallelizer.layouts`): ``fused`` when its output is
split into parts (q|k|v), ``replicated_heads`` for GQA kv heads when tp exceeds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..errors import PlanError
from ..passes.graph_facts import aten, linear_sites
from ..passes.sharding import Propagation, propagate

_STOP = {aten.embedding.default, aten.native_layer_norm.default, aten.layer_norm.default}
_WALK_LIMIT = 400


@dataclass
class TPDecision:
    """Column/row weight FQNs (get_attr targets), the shape-constant rewrites and the
    report. ``biases`` maps a linear weight FQN to its bias FQN; ``dims`` maps every sharded
    weight and column bias to its sharded dim (``tp_dim``), ``layouts`` those with a layout
    other than the even split to it (JSON data, :mod:`parallelizer.layouts`)."""

    column: set = field(default_factory=set)
    row: set = field(default_factory=set)
    biases: dict = field(default_factory=dict)
    dims: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # also printed by the CLI
    # node name -> None (Replicate) | sharded dim, of the settled propagation; empty at tp=1
    placements: dict = field(default_factory=dict)


def plan_tp(graph: fx.Graph, tp: int) -> TPDecision:
    """Decide the Megatron column/row pairs for ``graph`` at tp degree ``tp``.

    Raises:
        PlanError: tp does not divide a sharded size (heads, kv heads, features); the
            message names ``mesh.tp``, the module and the tp degrees that would work.
    """
    decision = TPDecision()
    sites = linear_sites(graph)
    for site in sites:
        if site.bias:
            decision.biases[site.weight] = site.bias
    if tp == 1:
        return decision
    pairs = _seed_pairs(sites)
    column = {c for c, rows in pairs.items() if rows}
    row = {r for rows in pairs.values() for r in rows}
    prop = _settle(graph, pairs, column, row, tp, decision.report)
    _check_divisible(prop, tp)
    layouts = prop.found_layouts()
    decision.column, decision.row, decision.rewrites = column, row, prop.rewrites
    decision.placements = dict(prop.placements)
    for site in sites:
        w = site.weight
        if w in column or w in row:
            decision.dims[w] = site.out_dim if w in column else site.in_dim
        if w in column and site.bias:
            decision.dims[site.bias] = 0
        if w in column and w in layouts:
            decision.layouts[w] = layouts[w]
            if site.bias:
                decision.layouts[site.bias] = layouts[w]
    decision.report.insert(0, f"column_parallel: {len(column)} linears; row_parallel: "
                              f"{len(row)} linears; replicated: "
                              f"{len(sites) - len(column) - len(row)} linears")
    for w, layout in sorted(decision.layouts.items()):
        if w in column:
            decision.report.append(f"layout {_layout_text(layout)}: {w}")
    if not column:
        decision.warnings.append(
            f"mesh.tp={tp} but no linear layer could be sharded (no column/row pair of "
            f"aten.linear or Conv1D addmm layers was found): every rank holds the whole "
            f"model; see report.md")
    paired = {w for c, rows in pairs.items() if rows for w in {c} | rows}
    for site in sites:
        if site.weight not in paired:
            decision.report.append(f"replicated linear: {site.weight} (no column/row pair found)")
    return decision


def _layout_text(layout: dict) -> str:
    if layout["kind"] == "fused":
        return f"fused {layout['parts']}"
    if layout["kind"] == "replicated_heads":
        return (f"replicated_heads ({layout['heads']} heads of {layout['head_dim']}, each held "
                f"by tp / {layout['heads']} ranks; their gradients are summed)")
    return layout["kind"]


def _settle(graph, pairs: dict, column: set, row: set, tp: int, report: list) -> Propagation:
    """Propagate until the layouts found are the layouts assumed (the rewrites follow them)
    and no conflict is left; groups in conflict are removed from ``column``/``row``."""
    layouts, no_replication = {}, frozenset()
    for _ in range(4 * (len(column) + len(row)) + 8):
        prop = propagate(graph, column, row, tp, layouts, no_replication)
        if prop.not_replicable - no_replication:
            no_replication |= prop.not_replicable
            continue
        found = prop.found_layouts()
        if found != layouts:
            layouts = found
            continue
        conflicts = prop.conflicts + [(n, "", frozenset({w}), r)
                                      for w, n, r in prop.layout_conflicts()]
        if not conflicts:
            return prop
        node, module, groups, reason = conflicts[0]
        bad = _component(pairs, groups or column)
        report.append(f"kept replicated: {', '.join(sorted(bad))} "
                      f"(at {node} in {module or 'the root module'}: {reason})")
        column -= bad
        row -= bad
    raise AssertionError("tp planning did not settle")  # each round removes or fixes something


def _seed_pairs(sites: list) -> dict:
    """column weight FQN -> row weight FQNs its output reaches as their input."""
    pairs, taken = {}, set()
    is_linear = {s.node: s for s in sites}
    for site in sites:
        w = site.weight
        if w in taken:
            pairs[w] = set()
            continue
        reached = _walk(site.node, is_linear)
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
                if is_linear[user].x is node:
                    reached.add(is_linear[user].weight)
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


def _check_divisible(prop: Propagation, tp: int) -> None:
    kv = frozenset(prop.kv_weights)
    bad = [c for c in prop.constraints if not c.allows(tp, kv)]
    if not bad:
        return
    bad.sort(key=lambda c: c.what != "heads")
    c = bad[0]
    top = max(x.size for x in prop.constraints)
    valid = [t for t in range(1, top + 1) if all(x.allows(t, kv) for x in prop.constraints)]
    kv_heads = c.what == "heads" and c.replicable(kv)
    copies = ", or be a multiple of it (each kv head is then held by tp / kv heads ranks)"
    raise PlanError(
        f"mesh.tp ({tp}) must divide the number of {'kv heads' if kv_heads else c.what} "
        f"({c.size}) of {c.module or 'the model'} ({c.detail}){copies if kv_heads else ''}; "
        f"valid choices: tp in {{{', '.join(map(str, valid))}}}")
