"""In-place writes of a captured graph, found by the ATen schemas' write annotations
(``Tensor(a!)``: ``add_``, ``copy_``, ``index_put_``, an ``out=``) and followed back through
views (a return that aliases its input, ``Tensor(a)``) to the tensor written: a parameter an
op updates in forward (analysis/parameter_writes.py), the buffers BatchNorm's count
``add_`` writes (passes/recompute_writes.py), what a pipeline split must keep in one stage
(passes/split_check.py)."""
from __future__ import annotations

import torch.fx as fx

from ..frontend.graph_rewrite import returns_view, view_base, written_inputs


def written_attrs(graph: fx.Graph) -> dict:
    """get_attr targets some op of ``graph`` writes in place (an argument its schema marks
    written, ``Tensor(a!)``: ``add_``, ``copy_``, ``index_put_``), directly or through views
    of them (a return that aliases its input, ``Tensor(a)``) -> the first node writing it."""
    out: dict = {}
    for n in graph.nodes:
        for _i, base in written_args(n):
            if base.op == "get_attr":
                out.setdefault(base.target, n)
    return out


def written_nodes(graph: fx.Graph) -> set:
    """The nodes whose value some op of ``graph`` changes in place after they are made:
    each tensor an op writes (through views, as :func:`written_attrs`) and every view of it
    (``mask = ones(b, t); mask[:, :k] = 0`` writes ``ones`` through its slices). Copying
    such a node's producers elsewhere copies the value before the write."""
    out = set()
    for n in graph.nodes:
        for _i, base in written_args(n):
            if base not in out:
                out |= views_of(base)
    return out


def views_of(base: fx.Node) -> set:
    """``base`` and every view of it, through chains of views (a return that aliases its
    first argument, ``Tensor(a)``)."""
    out, todo = set(), [base]
    while todo:
        node = todo.pop()
        if node not in out:
            out.add(node)
            todo += [u for u in node.users if returns_view(u) and u.args[0] is node]
    return out


def written_buffer_args(node: fx.Node, buffers) -> list[int]:
    """Indices of the arguments ``node`` writes in place (as :func:`written_attrs` reads the
    schema) that are, or are views of, a get_attr of a name in ``buffers``."""
    return [i for i, base in written_args(node) if base.op == "get_attr" and base.target in buffers]


def written_args(n: fx.Node) -> list:
    """``(argument index, the node it is a view of)`` for each argument ``n`` writes."""
    return [(i, view_base(value)) for i, value in written_inputs(n)]
