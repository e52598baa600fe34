"""Mixture-of-experts layers of a captured graph, found by their algebra, not by class name.

An expert layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020) is found from its
**stacked expert weights**: parameters of shape (E, a, b), one (a, b) matrix per expert.
Each is read by a **grouped matmul**: an op with three tensor operands, rows (S, a) sorted by
expert, the weight (E, a, b) (maybe through a transpose or a cast) and ``offs`` (E,) integer,
the cumulative rows per expert (transformers' ``grouped_mm_fallback``, ``torch._grouped_mm``,
``F.grouped_mm``, torchtitan's GroupedExperts all have this form). The grouped matmuls that
share one ``offs`` are one layer's experts. Between them the model computes row by row
(gate/up chunk, activation, product): the **expert region** is the grouped matmuls and the
row-wise ops between them. Rows enter it from outside (the sorted tokens: what expert
parallelism dispatches) and leave it at its exits (what it combines). The **router** is the
linear whose output reaches the ``top-k`` that ``offs`` is counted from; the model's own
weighting by the router probabilities, un-permuting and top-k sum stay outside the region.

A 3-D parameter is a stacked expert weight when a grouped matmul reads it or something takes
its matrices out along dim 0 (``W[i]``, ``W[expert_ids]``); a Conv1d's weight or a
(1, tokens, dim) position table is neither. Anything but a grouped matmul reading stacked
weights (a per-row gather ``W[expert_ids]`` as transformers' ``batched_mm`` does, an ``eager``
per-expert loop) is reported as an unsupported layout with the op and the module, so
``mesh.ep`` can refuse it by name.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph_facts import aten, is_tensor, module_path, same, shape, source_line
from .linears import linear_sites

_VIEWS = {aten.transpose.int, aten.t.default, aten.permute.default, aten._to_copy.default,
          aten.to.dtype, aten.contiguous.default, aten.alias.default}
_ROW_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default,
               aten.slice.Tensor, aten.narrow.default}
_ROW_KEEPING = {aten._to_copy.default, aten.to.dtype, aten.clone.default,
                aten.contiguous.default, aten.alias.default}
_IGNORED = {aten._assert_tensor_metadata.default}
# ops taking one expert's matrix (or a row's expert's) out of a stacked weight along dim 0
_SELECTIONS = {aten.index.Tensor, aten.select.int, aten.index_select.default, aten.unbind.int}
_WALK = 200


@dataclass(frozen=True)
class ExpertLayer:
    """One expert layer of the graph (node names are the captured graph's).

    Attributes:
        module: FQN of the module holding the stacked weights (``model.layers.0.mlp.experts``).
        num_experts: E, dim 0 of every stacked weight.
        weights: FQNs of the stacked weights, (E, ...) each.
        offsets: the ``offs`` node (E,) the grouped matmuls share.
        inputs: nodes of the rows entering the region (S, ...), sorted by expert.
        outputs: region nodes whose rows leave it (S, ...).
        matmuls: the grouped-matmul nodes.
        region: every node of the region (grouped matmuls and the row-wise ops between).
        router: weight FQN of the router linear ('' when not found).
        where: model source line of the first grouped matmul.
    """

    module: str
    num_experts: int
    weights: tuple
    offsets: str
    inputs: tuple
    outputs: tuple
    matmuls: tuple
    region: tuple = ()
    router: str = ""
    where: str = ""


@dataclass(frozen=True)
class Unsupported:
    """Expert weights read in a layout expert parallelism does not run: stacked ones read
    other than by a grouped matmul, or a list of expert modules that cannot be stacked
    (analysis/expert_modules.py); ``fix`` is what the user can change."""

    module: str
    weight: str
    reason: str
    fix: str = ("use transformers' grouped_mm experts implementation (config._experts_implementation"
                " = 'grouped_mm'), or set mesh.ep=1")


def find_expert_layers(graph: fx.Graph) -> tuple[list[ExpertLayer], list[Unsupported]]:
    """The expert layers of ``graph`` in graph order, and the stacked weights read otherwise."""
    groups: dict = {}
    unsupported = []
    for param in (n for n in graph.nodes if n.op == "get_attr" and _stacked(n)):
        uses = [(use, via, _grouped_mm_offs(use, via, shape(param)[0])) for use, via in _uses(param)]
        if not any(offs is not None or _selects_experts(use, via) for use, via, offs in uses):
            continue  # a Conv1d's weight, a (1, tokens, dim) position table: no expert matrices
        for use, via, offs in uses:
            if offs is not None:
                groups.setdefault(offs, {}).setdefault(use, param.target)
            elif use.target not in _IGNORED:
                where = source_line(use)
                unsupported.append(Unsupported(
                    module_path(use) or param.target.rsplit(".", 1)[0], param.target,
                    f"read by {use.target}{' at ' + where if where else ''}, not by a grouped "
                    f"matmul (rows sorted by expert, the (E, in, out) weight, cumulative rows per "
                    f"expert)"))
    layers = [_layer(offs, mms) for offs, mms in groups.items()]
    return sorted(layers, key=lambda l: _order(graph)[l.matmuls[0]]), unsupported


def _order(graph: fx.Graph) -> dict:
    return {n.name: i for i, n in enumerate(graph.nodes)}


def _stacked(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() == 3 and v.is_floating_point()


def _uses(param: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(op reading the weight, the operand it reads) through transposes and casts."""
    out, frontier = [], [param]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in _VIEWS:
                frontier.append(u)
            else:
                out.append((u, n))
    return out


def _selects_experts(op: fx.Node, weight: fx.Node) -> bool:
    """``op`` takes matrices out of ``weight`` (E, a, b) along dim 0: ``W[i]``, ``W[ids]``,
    ``W.index_select(0, ids)``, ``W.unbind(0)`` (transformers' eager loop and batched_mm)."""
    if op.op != "call_function" or op.target not in _SELECTIONS or op.args[0] is not weight:
        return False
    if op.target is aten.index.Tensor:
        return bool(op.args[1]) and op.args[1][0] is not None
    dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    return dim == 0


def _grouped_mm_offs(op: fx.Node, weight: fx.Node, experts: int):
    """``offs`` of ``op`` when it is a grouped matmul reading ``weight`` (E, a, b), else None."""
    if op.op != "call_function":
        return None
    tensors = [a for a in list(op.args) + list(op.kwargs.values()) if isinstance(a, fx.Node)]
    if len(tensors) != 3 or weight not in tensors or not is_tensor(op) or len(shape(op)) != 2:
        return None
    rows = [a for a in tensors if a is not weight and is_tensor(a) and len(shape(a)) == 2]
    offs = [a for a in tensors if a is not weight and is_tensor(a) and len(shape(a)) == 1
            and not a.meta["val"].is_floating_point() and same(shape(a)[0], experts)]
    if len(rows) != 1 or len(offs) != 1 or not same(shape(rows[0])[0], shape(op)[0]):
        return None
    return offs[0]


def _layer(offs: fx.Node, mms: dict) -> ExpertLayer:
    region, inputs = row_region(list(mms), offs)
    outputs = [n for n in region if any(u not in region and u.target not in _IGNORED for u in n.users)]
    first = min(mms, key=lambda n: _order(n.graph)[n.name])
    weights = tuple(dict.fromkeys(mms[m] for m in sorted(mms, key=lambda n: _order(n.graph)[n.name])))
    module = module_path(first) or weights[0].rsplit(".", 1)[0]
    return ExpertLayer(module, int(shape(offs)[0]), weights, offs.name,
                       tuple(n.name for n in inputs), tuple(n.name for n in outputs),
                       tuple(sorted((m.name for m in mms), key=_order(offs.graph).get)),
                       tuple(n.name for n in region), _router(offs), source_line(first))


def row_region(mms: list, offs) -> tuple[list, list]:
    """The matmuls ``mms`` and the row-wise ops between them, in graph order; the rows
    entering from outside. ``offs`` (a node or None) is never part of the region."""
    rows = shape(mms[0])[0]
    region, frontier, inputs = set(mms), list(mms), []
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in region and _row_wise(u, rows, offs):
                region.add(u)
                frontier.append(u)
    region = _trim(region, set(mms))
    order = _order(mms[0].graph)
    region = sorted(region, key=lambda n: order[n.name])
    for n in region:
        inputs += [a for a in n.all_input_nodes if _is_rows(a, rows) and a not in region]
    return region, list(dict.fromkeys(inputs))


def _trim(region: set, mms: set) -> set:
    """Keep the grouped matmuls and the region ops on a path between two of them (the chain
    gate_up -> activation -> down); what follows the last matmul is the model's combine."""
    reaches = set(mms)
    changed = True
    while changed:
        changed = False
        for n in region - reaches:
            if any(u in reaches for u in n.users):
                reaches.add(n)
                changed = True
    return reaches


def _is_rows(a, rows) -> bool:
    return is_tensor(a) and len(shape(a)) >= 1 and same(shape(a)[0], rows)


def _row_wise(u: fx.Node, rows, offs) -> bool:
    """``u`` computes each output row from the same row of its row inputs only."""
    if u.op != "call_function" or u is offs:
        return False
    if u.target is operator.getitem:
        return isinstance(u.args[1], int) and _is_rows(u, rows)
    if full_row_slice(u):  # x[:, ...]: every row, as it is
        return _is_rows(u, rows)
    if u.target in _ROW_SPLITS:
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
        if u.target in (aten.slice.Tensor, aten.narrow.default):
            dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
        return dim % len(shape(u.args[0])) != 0
    if u.target in _ROW_KEEPING:
        return _is_rows(u, rows)
    pointwise = torch.Tag.pointwise in getattr(u.target, "tags", ())
    return pointwise and _is_rows(u, rows)


def full_row_slice(u: fx.Node) -> bool:
    """``u`` is ``x[:]`` along dim 0 (what ``x[:, :f]`` records first): the rows unchanged."""
    if u.op != "call_function" or u.target is not aten.slice.Tensor:
        return False
    args = list(u.args) + [None] * 4
    dim, lo, hi, step = args[1] or 0, args[2] or 0, args[3], args[4] or 1
    return dim == 0 and lo == 0 and step == 1 and (hi is None or (isinstance(hi, int) and hi >= 2 ** 62))


def _router(offs: fx.Node) -> str:
    """Weight FQN of the linear whose output reaches the top-k ``offs`` is counted from."""
    seen, frontier, topk = set(), [offs], None
    while frontier and len(seen) < _WALK and topk is None:
        n = frontier.pop(0)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                if a.op == "call_function" and a.target is aten.topk.default:
                    topk = a
                frontier.append(a)
    if topk is None:
        return ""
    sites = {s.node: s.weight for s in linear_sites(offs.graph)}
    seen, frontier = set(), [topk]
    while frontier and len(seen) < _WALK:
        n = frontier.pop(0)
        if n in sites:
            return sites[n]
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                frontier.append(a)
    return ""
