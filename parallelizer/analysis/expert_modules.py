"""Mixture-of-experts layers whose experts are a list of modules, found on the graph.

Mixtral's and DeepSeek's reference code (and transformers before its grouped experts) keep
the experts as an ``nn.ModuleList`` of MLPs and loop over them: each expert ``i`` takes its
own rows (``torch.where`` of the routing mask, an index of the tokens) through its linears.
Captured, the loop is unrolled: E copies of one computation, each on its own rows and its
own weights ``P.i.<name>``. Such a layer is one this module can prove the ``stack_experts``
pass (passes/stack_experts.py) may rewrite into the stacked form expert parallelism runs
(rows concatenated, weights (E, out, in), grouped matmuls; analysis/experts.py finds it
afterwards). The proof, on the graph, not on class names:

- the children ``P.0`` ... ``P.{E-1}`` (E >= 2 of one module) are routed: each reads rows
  selected for it alone (``x[idx]``, ``x[mask]``, ``index_select``: not the tensor every
  child reads, as attention heads or parallel branches do) and none reads another's output (a
  list of transformer layers is not a list of experts: each reads the one before). A routed
  list failing any rule below is reported with the reason and the fix, not passed over;
- the linears reading ``P.i.*`` are, per child, bias-free ``F.linear``s on 2-D rows, each
  called once; with the row-wise ops between them (what
  :func:`~parallelizer.analysis.experts.row_region` keeps) they form the child's region;
- every region reads only its rows from outside (no other tensor, no size of its own rows)
  and its child's weights, each of them in exactly one linear;
- the regions are the same computation (op for op, argument for argument, weight slot for
  weight slot).

Then ``cat(rows_i)`` through the region with expert ``i``'s weights on its segment, split
back, computes what the loop computes, row for row.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from .experts import Unsupported, row_region
from .graph_facts import aten, is_tensor, shape, same, source_line
from .linears import linear_sites

_CHILD = re.compile(r"^(.*)\.(\d+)\.([A-Za-z_].*)$")


@dataclass(frozen=True)
class ModuleExperts:
    """One layer of per-module experts (node names are the captured graph's).

    Attributes:
        module: FQN of the module list (``model.layers.0.block_sparse_moe.experts``).
        slots: weight names inside one expert, in the template's order (``w1.weight``).
        weights: per expert, the FQN of each slot.
        regions: per expert, its region's nodes in graph order (the same op at each position).
        inputs: per expert, the row tensors entering its region (same order for all).
        outputs: per expert, the region nodes whose rows leave it (same order for all).
        linears: positions in the region of the linears, and the slot each reads.
        where: model source line of expert 0's first linear.
    """

    module: str
    slots: tuple
    weights: tuple
    regions: tuple
    inputs: tuple
    outputs: tuple
    linears: tuple
    where: str = ""

    @property
    def num_experts(self) -> int:
        return len(self.weights)

    def stacked(self) -> dict:
        """Stacked FQN (``<module>.<slot>``) -> the experts' FQNs it stacks, in expert order."""
        return {f"{self.module}.{s}": tuple(w[k] for w in self.weights) for k, s in enumerate(self.slots)}


def find_module_experts(graph: fx.Graph) -> tuple[list[ModuleExperts], list[Unsupported]]:
    """The per-module expert layers of ``graph``, and routed module lists (each child on rows
    of its own, independent of the others) that cannot be stacked, with the reason and fix."""
    by_parent: dict = {}
    for site in linear_sites(graph):
        m = _CHILD.match(site.weight)
        if m:
            by_parent.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(site)
    layers, unsupported = [], []
    for parent, children in by_parent.items():
        if len(children) < 2 or sorted(children) != list(range(len(children))):
            continue
        found = _layer(graph, parent, [children[i] for i in range(len(children))])
        if isinstance(found, ModuleExperts):
            layers.append(found)
        elif found:
            reason, fix = found if isinstance(found, tuple) else (found, _FIX)
            unsupported.append(Unsupported(
                parent, children[0][0].weight, f"a list of expert modules that cannot be "
                f"stacked into one grouped computation: {reason}", fix))
    return layers, unsupported


_FIX = ("make the experts bias-free F.linear layers computing the same thing on their rows "
        "only, or set mesh.ep=1")


def _layer(graph: fx.Graph, parent: str, children: list):
    """The layer; a reason it cannot be stacked (or (reason, fix)); '' when ``parent`` is no
    expert list: its children do not each run on rows selected for it (transformer blocks
    read the one before, attention heads or parallel branches all read the same tensor)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    spans = [_span(sites, order) for sites in children]
    if not _routed(spans):
        return ""
    closed = _closed(spans, order)
    if closed is None:
        return ""
    for i, sites in enumerate(children):
        calls = _calls(parent, i, sites)
        if calls:
            return calls
        if closed[i] is not None:
            n = closed[i]
            return (f"{parent}.{i}: {n.target} ({source_line(n)}) between its linears is not an op "
                    f"that computes each row from the same row alone, so the experts' rows cannot "
                    f"run through it at once",
                    "keep only row-wise ops (activations, products, casts) between an expert's "
                    "linears (dropout after the expert, not inside it), or set mesh.ep=1")
        flat = next((s for s in sites if not _rows_2d(s)), None)
        if flat is not None:
            return (f"{parent}.{i}: {flat.weight}'s linear ({source_line(flat.node)}) runs on rows "
                    f"of shape {tuple(shape(flat.x))}; experts are stacked on 2-D rows (tokens, dim)",
                    "call each expert on its (tokens, dim) rows (expert(x[idx]), not "
                    "expert(x[None, idx])), or set mesh.ep=1")
    parts = [_check(parent, i, sites, *span) for i, (sites, span) in enumerate(zip(children, spans))]
    bad = next((p for p in parts if isinstance(p, str)), None)
    if bad is not None:
        return bad
    signatures = [p["signature"] for p in parts]
    if any(s != signatures[0] for s in signatures[1:]):
        i = next(i for i, s in enumerate(signatures) if s != signatures[0])
        return (f"expert {i} of {parent} does not compute what expert 0 computes (its ops or "
                f"their arguments differ), so the experts cannot share one grouped computation")
    slots = tuple(dict.fromkeys(slot for _, slot in parts[0]["linears"]))
    first = parts[0]["region"][parts[0]["linears"][0][0]]
    return ModuleExperts(
        parent, slots, tuple(tuple(f"{parent}.{i}.{s}" for s in slots) for i in range(len(parts))),
        tuple(tuple(n.name for n in p["region"]) for p in parts),
        tuple(tuple(n.name for n in p["inputs"]) for p in parts),
        tuple(tuple(n.name for n in p["outputs"]) for p in parts),
        parts[0]["linears"], source_line(first))


def _rows_2d(site) -> bool:
    return is_tensor(site.x) and len(shape(site.x)) == 2 and len(shape(site.node)) == 2


def _span(sites: list, order: dict) -> tuple[list, list]:
    """A child's region (its linears and the row-wise ops between them) and its inputs."""
    region, inputs = row_region([s.node for s in sites], None)
    return region, sorted(inputs, key=order.get)


def _check(parent: str, i: int, sites: list, region: list, inputs: list):
    """Expert ``i``'s region, inputs, outputs and signature, or why it cannot be stacked."""
    where = f"{parent}.{i}"
    members, weights = set(region), {s.node: s for s in sites}
    for s in sites:
        if s.bias is not None or s.node.target is not aten.linear.default or s.w_node is not s.param:
            return (f"{where}: {s.weight} is read by {s.node.target} ({source_line(s.node)}), "
                    f"not by a bias-free F.linear of its rows")
        if len(s.param.users) != 1:
            return f"{where}: {s.weight} is read outside its expert's linear"
    index = {n: k for k, n in enumerate(region)}
    slot_of = {n: weights[n].weight.removeprefix(f"{where}.") for n in region if n in weights}

    def norm(a, n):
        if isinstance(a, fx.Node):
            if a in index:
                return ("r", index[a])
            if a in inputs:
                return ("in", inputs.index(a))
            if n in weights and a is weights[n].param:
                return ("w", slot_of[n])
            raise _Outside(a, n)
        if isinstance(a, (list, tuple)):
            return tuple(norm(b, n) for b in a)
        if isinstance(a, dict):
            return tuple(sorted((k, norm(v, n)) for k, v in a.items()))
        return repr(a)

    try:
        signature = tuple((str(n.target), norm(n.args, n), norm(n.kwargs, n)) for n in region)
    except _Outside as e:
        return (f"{where}: {e.node.target} ({source_line(e.node)}) reads {e.arg.name} from "
                f"outside the expert, not one of its rows")
    if not all(same(shape(x)[0], shape(inputs[0])[0]) for x in inputs):
        return f"{where}: the rows entering the expert differ in number"
    return {"region": region, "inputs": inputs, "signature": signature,
            "outputs": [n for n in region if any(u not in members for u in n.users)],
            "linears": tuple((index[n], slot_of[n]) for n in region if n in weights)}


class _Outside(Exception):
    def __init__(self, arg, node):
        super().__init__(arg.name)
        self.arg, self.node = arg, node


def _calls(parent: str, i: int, sites: list):
    """Why expert ``i`` cannot be stacked when a linear of it runs more than once ('' if none)."""
    reads: dict = {}
    for s in sites:
        reads.setdefault(s.weight, []).append(s.node)
    weight, nodes = max(reads.items(), key=lambda kv: len(kv[1]))
    if len(nodes) < 2:
        return ""
    where = ", ".join(dict.fromkeys(source_line(n, outer=1) or source_line(n) for n in nodes))
    return (f"{parent}.{i} is called {len(nodes)} times (at {where}; {weight} is read each "
            f"time), once per call site or top-k choice; the stacked form runs each expert once "
            f"on all its rows",
            "give each expert all its rows in one call (the rows of every top-k choice: "
            "torch.where(selected == i) on the (tokens, k) choices), or set mesh.ep=1")


def _ancestors(inputs: list, start: int, order: dict) -> set:
    """Every node ``inputs`` depend on from graph position ``start`` on (nothing earlier can
    depend on a node after it)."""
    seen, frontier = set(), list(inputs)
    while frontier:
        n = frontier.pop()
        if n in seen or order[n] < start:
            continue
        seen.add(n)
        frontier += n.all_input_nodes
    return seen


def _closed(spans: list, order: dict):
    """Per child, None or the input of its region that depends on the region itself (an op
    between its linears that is not row-wise: a dropout); None overall when a child's inputs
    depend on another child's region (each layer of a stack reads the one before)."""
    regions = [set(region) for region, _ in spans]
    start = min(order[n] for region in regions for n in region)
    out = []
    for i, (_, inputs) in enumerate(spans):
        before = _ancestors(inputs, start, order)
        if any(before & r for k, r in enumerate(regions) if k != i):
            return None
        out.append(next((x for x in inputs if _ancestors([x], start, order) & regions[i]), None)
                   if before & regions[i] else None)
    return out


_SELECTIONS = {aten.index.Tensor, aten.index_select.default, aten.masked_select.default}
_ROUTE_DEPTH = 12


def _routed(spans: list) -> bool:
    """Every child reads rows selected for it alone: near its inputs (within a few ops: an
    RMSNorm inside the expert) is a row selection by a tensor (``x[idx]``, ``x[mask]``,
    ``index_select``) that no other child's inputs come from."""
    found = [_selections(inputs) for _, inputs in spans]
    return all(f - set().union(*(g for k, g in enumerate(found) if k != i))
               for i, f in enumerate(found))


def _selections(inputs: list) -> set:
    seen, frontier, out = set(), [(x, 0) for x in inputs], set()
    while frontier:
        n, depth = frontier.pop()
        if n in seen or depth > _ROUTE_DEPTH:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in _SELECTIONS:
            out.add(n)
        frontier += [(a, depth + 1) for a in n.all_input_nodes]
    return out
