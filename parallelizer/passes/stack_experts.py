"""The stack_experts pass: a layer of per-module experts becomes one grouped computation.

For each :class:`~parallelizer.analysis.expert_modules.ModuleExperts` layer (E experts, each
a region of bias-free linears and row-wise ops on its own rows, proven identical and
independent there), the pass writes, after the last expert's rows exist:

``X = cat(rows_0, ..., rows_{E-1})``   the rows sorted by expert
``offs = parallelizer.row_offsets(rows_0, ..., rows_{E-1})``
expert 0's region on ``X``, each ``linear(x, P.0.w)`` replaced by
``parallelizer.grouped_mm(x, P.w.transpose(1, 2), offs)`` with ``P.w`` (E, out, in) the
experts' weights stacked, then ``split(Y, [n_0, ..., n_{E-1}])`` in place of each expert's
output. The model's own code around the experts (routing, the index of each expert's rows,
the weighting, the ``index_add``) is not touched. Nodes that read an expert's output move
after the grouped computation (a stable topological order); an in-place op whose other
readers would change sides of it is refused (PlanError), so the rewrite cannot reorder a
write and a read.

The stacked weights replace the experts' parameters in the program, its checkpoints and its
reference (``stacked``: stacked FQN -> the experts' FQNs; ``parallelize export`` writes the
experts' own names back). analysis/experts.py then finds the layer as it finds
transformers' grouped experts, and expert parallelism splits dim 0 of the stacked weights.
"""
from __future__ import annotations

import operator
from operator import attrgetter

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg

from ..analysis.expert_modules import ModuleExperts
from ..analysis.graph_facts import clean_path
from ..errors import PlanError
from ..frontend.graph_rewrite import written_inputs
from ..runtime import grouped_mm  # noqa: F401  (registers parallelizer::grouped_mm)

aten = torch.ops.aten


def apply_stack_experts(gm: fx.GraphModule, layers: list[ModuleExperts], stacked: dict) -> bool:
    """Rewrite ``gm`` in place, recording stacked FQN -> the experts' FQNs (in expert order)
    in ``stacked``; returns whether anything changed.

    Raises:
        PlanError: a stacked name is taken, or an in-place op would change order with a read.
    """
    if not layers:
        return False
    for layer in layers:
        stacked.update(_stack(gm, layer))
    _reorder(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return True


def _stack(gm: fx.GraphModule, layer: ModuleExperts) -> dict:
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    fake = detect_fake_mode([by_name[layer.inputs[0][0]].meta["val"]])
    names = layer.stacked()
    params = {slot: _register(gm, fqn, members) for slot, (fqn, members) in zip(layer.slots, names.items())}
    inputs = [[by_name[x] for x in xs] for xs in layer.inputs]
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max((x for xs in inputs for x in xs), key=order.get)
    make = _Maker(graph, anchor, fake, layer.module)
    cat = [make.call(aten.cat.default, ([xs[k] for xs in inputs],), inputs[0][k])
           for k in range(len(inputs[0]))]
    offs = make.call(torch.ops.parallelizer.row_offsets.default, ([xs[0] for xs in inputs],), None)
    template = [by_name[n] for n in layer.regions[0]]
    new: dict = {x: c for x, c in zip(inputs[0], cat)}
    linears = dict(layer.linears)
    for pos, n in enumerate(template):
        if pos in linears:
            w = make.get_attr(f"{layer.module}.{linears[pos]}", params[linears[pos]])
            wt = make.call(aten.transpose.int, (w, 1, 2), None)
            new[n] = make.call(torch.ops.parallelizer.grouped_mm.default,
                               (new[n.args[0]], wt, offs), n)
        else:
            new[n] = make.call(n.target, map_arg(n.args, new.__getitem__), n,
                               map_arg(n.kwargs, new.__getitem__))
    sizes = [make.call(aten.sym_size.int, (xs[0], 0), None) for xs in inputs]
    for o, name in enumerate(layer.outputs[0]):
        parts = make.call(aten.split_with_sizes.default, (new[by_name[name]], sizes), None)
        for i, outs in enumerate(layer.outputs):
            by_name[outs[o]].replace_all_uses_with(make.call(operator.getitem, (parts, i), None))
    for region in reversed(layer.regions):
        for n in reversed([by_name[r] for r in region]):
            weight = n.args[1] if n.target is aten.linear.default else None
            graph.erase_node(n)
            if isinstance(weight, fx.Node) and not weight.users:
                graph.erase_node(weight)
    for members in names.values():
        for fqn in members:
            owner, _, leaf = fqn.rpartition(".")
            delattr(gm.get_submodule(owner), leaf)
    return names


def _register(gm: fx.GraphModule, fqn: str, members: tuple) -> torch.nn.Parameter:
    owner, _, leaf = fqn.rpartition(".")
    try:
        attrgetter(fqn)(gm)
    except AttributeError:
        pass
    else:
        raise PlanError(f"stacking the experts {members[0]} ... {members[-1]} needs the name "
                        f"{fqn}, which the model already uses; rename that attribute")
    first = attrgetter(members[0])(gm)
    param = torch.nn.Parameter(torch.stack([attrgetter(m)(gm).detach() for m in members]),
                               requires_grad=first.requires_grad)
    module = gm
    for part in owner.split("."):
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)
    return param


class _Maker:
    """New nodes in order after ``anchor``, each with its FakeTensor value and the meta of
    the node it stands for (source line; module stack up to the expert list ``module``: the
    grouped computation belongs to the list, not to expert 0)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake, module: str):
        self.graph, self.last, self.fake, self.module = graph, anchor, fake, module

    def call(self, target, args, like, kwargs=None) -> fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.call_function(target, args, kwargs or {})
        return self._done(node, like, lambda: target(*_vals(args), **_vals(kwargs or {})))

    def get_attr(self, fqn: str, param: torch.Tensor) -> fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.get_attr(fqn)
        return self._done(node, None, lambda: self.fake.from_tensor(param, static_shapes=True))

    def _done(self, node, like, value) -> fx.Node:
        meta = (like if like is not None else self.last).meta
        node.meta = {k: meta[k] for k in ("stack_trace",) if k in meta}
        stack = {k: v for k, v in (meta.get("nn_module_stack") or {}).items()
                 if not clean_path(v[0]).startswith(self.module + ".")}
        if len(stack) < len(meta.get("nn_module_stack") or {}):
            stack[f"L__self__{self.module}"] = (self.module, "torch.nn.modules.container.ModuleList")
        node.meta["nn_module_stack"] = stack
        with self.fake:
            node.meta["val"] = value()
        self.last = node
        return node


def _vals(a):
    return map_arg(a, lambda n: n.meta["val"])


def _reorder(graph: fx.Graph) -> None:
    """Stable topological order (a node moves only after what it reads), refused where an
    in-place op and another reader of its operand would swap."""
    old = {n: i for i, n in enumerate(graph.nodes)}
    done, out = set(), []

    def visit(n):
        stack = [(n, False)]
        while stack:
            m, expanded = stack.pop()
            if m in done:
                continue
            if expanded:
                done.add(m)
                out.append(m)
                continue
            stack.append((m, True))
            stack += [(a, False) for a in reversed(m.all_input_nodes) if a not in done]

    for n in list(graph.nodes):
        visit(n)
    new = {n: i for i, n in enumerate(out)}
    _check_writes(out, old, new)
    prev = None
    for n in out:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n


def _check_writes(nodes: list, old: dict, new: dict) -> None:
    for n in nodes:
        for _i, value in written_inputs(n):
            for u in value.users:
                if u is not n and (old[u] < old[n]) != (new[u] < new[n]):
                    raise PlanError(
                        f"stacking the experts would move {u.name} ({u.target}) to the other "
                        f"side of {n.name} ({n.target}), which writes {value.name} in place; "
                        f"the per-module experts cannot be rewritten (use grouped experts)")
