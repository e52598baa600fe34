"""Mixture-of-experts layers whose experts are a list of modules, found on the graph.

Mixtral's and DeepSeek's reference code (and transformers before its grouped experts) keep
the experts as an ``nn.ModuleList`` of MLPs and loop over them: each expert ``i`` takes its
own rows (``torch.where`` of the routing mask, an index of the tokens) through its linears.
Captured, the loop is unrolled: E copies of one computation, each on its own rows and its
own weights ``P.i.<name>``. Such a layer is one this module can prove the ``stack_experts``
pass (passes/stack_experts.py) may rewrite into the stacked form expert parallelism runs
(rows concatenated, weights (E, out, in), grouped matmuls; analysis/experts.py finds it
afterwards). The proof, on the graph, not on class names:

- the linears reading ``P.0.*`` ... ``P.{E-1}.*`` (E >= 2 children of one module) are, per
  child, bias-free ``F.linear``s on 2-D rows; with the row-wise ops between them (what
  :func:`~parallelizer.analysis.experts.row_region` keeps) they form the child's region;
- every region reads only its rows from outside (no other tensor, no size of its own rows)
  and its child's weights, each of them in exactly one linear;
- the regions are the same computation (op for op, argument for argument, weight slot for
  weight slot) and none depends on another's output (a list of transformer layers is not a
  list of experts: each reads the one before).

Then ``cat(rows_i)`` through the region with expert ``i``'s weights on its segment, split
back, computes what the loop computes, row for row.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx

from .experts import Unsupported, row_region
from .graph_facts import aten, is_tensor, linear_sites, shape, same, source_line

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
    """The per-module expert layers of ``graph``, and module lists that look like experts
    (same linears per child, 2-D rows, independent) but cannot be stacked, with the reason."""
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
            unsupported.append(Unsupported(
                parent, children[0][0].weight, f"a list of expert modules that cannot be "
                f"stacked into one grouped computation: {found}",
                "make the experts bias-free F.linear layers computing the same thing on their "
                "rows only, or set mesh.ep=1"))
    return layers, unsupported


def _layer(graph: fx.Graph, parent: str, children: list):
    """The layer, a reason it cannot be stacked, or '' when ``parent`` is no expert list."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if not all(_rows_2d(s) for sites in children for s in sites):
        return ""
    spans = [_span(sites, order) for sites in children]
    if not _independent(spans, order):
        return ""
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


def _independent(spans: list, order: dict) -> bool:
    """No child's inputs depend on any child's region (ancestors walked back to the first
    region node: nothing earlier can depend on one)."""
    members = {n for region, _ in spans for n in region}
    start = min(order[n] for n in members)
    frontier = [x for _, inputs in spans for x in inputs]
    seen = set()
    while frontier:
        n = frontier.pop()
        if n in members:
            return False
        if n in seen or order[n] < start:
            continue
        seen.add(n)
        frontier += n.all_input_nodes
    return True
