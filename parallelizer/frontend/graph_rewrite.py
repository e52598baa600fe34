"""Helpers of the capture's graph rewrites (``einsum.py``, ``conv.py``): a node's FakeTensor
value, whether a node is a parameter read as it is, and new nodes that carry the rewritten
node's meta (module, source line) and a FakeTensor value, so that every planner reads the
rewritten graph as it reads a captured one."""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

# factories of a tensor of zeros, whose value reads nothing else's
ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}

# same values, same shape: a weight read through these is still the weight
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
         aten.type_as.default, aten.contiguous.default, aten.clone.default, aten.alias.default}


def val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_param(w: fx.Node, params: set) -> bool:
    """``w`` is a parameter read directly or through casts that keep its shape."""
    for _ in range(8):
        if w.op == "get_attr":
            return w.target in params
        if w.op != "call_function" or w.target not in CASTS or not w.args \
                or not isinstance(w.args[0], fx.Node):
            return False
        src = w.args[0]
        if not isinstance(val(src), torch.Tensor) or tuple(val(src).shape) != tuple(val(w).shape):
            return False
        w = src
    return False


def caller(graph: fx.Graph, node: fx.Node, inputs: list):
    """``call(target, *args)``: a new node of ``graph`` with ``node``'s meta (module, source
    line) and its FakeTensor value, computed in the fake mode of ``inputs``."""
    fake = detect_fake_mode(inputs)
    meta = {k: v for k, v in node.meta.items() if k != "val"}

    def call(target, *args):
        new = graph.call_function(target, args)
        vals = [[val(a) if isinstance(a, fx.Node) else a for a in arg] if isinstance(arg, list)
                else val(arg) if isinstance(arg, fx.Node) else arg for arg in args]
        with fake:
            new.meta = {**meta, "val": target(*vals)}
        return new
    return call


def swaps_last_two(n: fx.Node) -> bool:
    """``n`` transposes a 3-D value's dims 1 and 2 (``transpose(1, 2)``, ``mT``,
    ``permute(0, 2, 1)``): a stacked (E, a, b) weight read as (E, b, a)."""
    if n.op != "call_function" or not n.args:
        return False
    if n.target is aten.transpose.int:
        return sorted(a % 3 for a in n.args[1:3]) == [1, 2]
    if n.target is aten.permute.default:
        return [a % 3 for a in n.args[1]] == [0, 2, 1]
    return n.target is aten.mT.default


def returns_view(node: fx.Node) -> bool:
    """``node`` returns a view of (an alias into) its first argument, by its ATen schema
    (``Tensor(a)`` returns: ``slice``, ``view``, ``transpose``; ``Tensor(a!)``: an in-place op),
    or is one piece of a list of views (``getitem`` of ``chunk``, ``split``, ``unbind``)."""
    if node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[0], fx.Node):
        return returns_view(node.args[0])
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return (schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
            and bool(node.args) and isinstance(node.args[0], fx.Node))


def view_base(node: fx.Node) -> fx.Node:
    """The node ``node`` is a view of, through any chain of views (itself when
    :func:`returns_view` is false)."""
    while returns_view(node):
        node = node.args[0]
    return node


def written_inputs(node: fx.Node) -> list:
    """``(argument index, argument node)`` for each argument ``node`` writes in place by its
    ATen schema's write annotation (``Tensor(a!)``: ``add_``'s self, ``copy_``'s, an
    ``out=``), positional or keyword; empty for ops without a schema."""
    if node.op != "call_function":
        return []
    out = []
    for i, name in written_positions(node.target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, fx.Node):
            out.append((i, value))
    return out


@functools.lru_cache(maxsize=None)
def written_positions(target) -> tuple:
    """``(index, name)`` of each argument of the op ``target`` its schema marks written."""
    # per op, not per node: the gradient passes ask of every node of large graphs
    schema = getattr(target, "_schema", None)
    if schema is None:
        return ()
    return tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)
