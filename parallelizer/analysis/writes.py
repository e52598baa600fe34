"""In-place writes of a captured graph, found by the ATen schemas' write annotations
(``Tensor(a!)``: ``add_``, ``copy_``, ``index_put_``, an ``out=``) and followed back through
views (a return that aliases its input, ``Tensor(a)``) to the tensor written: a parameter an
op updates in forward (analysis/parameter_writes.py), the buffers BatchNorm's count
``add_`` writes (passes/recompute_writes.py), what a pipeline split must keep in one stage
(passes/split_check.py)."""
from __future__ import annotations

import torch.fx as fx


def written_attrs(graph: fx.Graph) -> dict:
    """get_attr targets some op of ``graph`` writes in place (an argument its schema marks
    written, ``Tensor(a!)``: ``add_``, ``copy_``, ``index_put_``), directly or through views
    of them (a return that aliases its input, ``Tensor(a)``) -> the first node writing it."""
    out: dict = {}
    for n in graph.nodes:
        for _i, base in _written(n):
            if base.op == "get_attr":
                out.setdefault(base.target, n)
    return out


def written_buffer_args(node: fx.Node, buffers) -> list[int]:
    """Indices of the arguments ``node`` writes in place (as :func:`written_attrs` reads the
    schema) that are, or are views of, a get_attr of a name in ``buffers``."""
    return [i for i, base in _written(node) if base.op == "get_attr" and base.target in buffers]


def _written(n: fx.Node) -> list:
    """``(argument index, the node it is a view of)`` for each argument ``n`` writes."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)  # out= too
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            out.append((i, _view_base(value)))
    return out


def _view_base(node: fx.Node) -> fx.Node:
    """The node ``node`` is a view of (itself when it is not the result of a view op)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None \
                or not node.args or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node
