"""Read-only facts about a captured graph: shapes, symbolic sizes, module paths and calls,
the source line a message names. Linear layers and their weight paths: ``linears.py``."""
from __future__ import annotations

import functools
from collections import Counter
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ..frontend.source_lines import trace_lines

aten = torch.ops.aten

# the emitted modules' device attribute (cleanup pass): read with get_attr, not a tensor
RUNTIME_DEVICE = "runtime_device"


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def input_values(gm: fx.GraphModule, input_names) -> list:
    """``(name, FakeTensor)`` of each placeholder of ``gm`` in ``input_names`` holding a tensor."""
    vals = [(n.name, n.meta.get("val")) for n in gm.graph.nodes
            if n.op == "placeholder" and n.name in input_names]
    return [(name, v) for name, v in vals if isinstance(v, torch.Tensor)]


def from_constants(node: fx.Node) -> bool:
    """``node`` is computed from parameters, buffers and constants alone (no placeholder
    upstream)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return False
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return True


def expr(x) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression, for exact symbolic comparison."""
    if isinstance(x, sympy.Expr):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def same(a, b) -> bool:
    """Whether two sizes are equal for every value of their symbols.

    ``sympy.simplify`` costs milliseconds per call and the view rule compares thousands of
    sizes on a 70B graph (18 s of a 31 s compile); an expanded polynomial is zero exactly
    when it is identically zero, so simplify is left for FloorDiv/Mod-like expressions, and
    their answers are kept: the planners ask the same few questions many times (SEW-D's
    conv lengths, 1408 calls to simplify for a handful of pairs: most of its tp plan's time).
    """
    ea, eb = expr(a), expr(b)
    return ea == eb or _same_exprs(ea, eb)


@functools.lru_cache(maxsize=4096)
def _same_exprs(a: sympy.Expr, b: sympy.Expr) -> bool:
    # the answer depends on the expressions alone, so one cache serves every graph
    diff = sympy.expand(a - b)
    if diff == 0:
        return True
    if diff.is_number or diff.is_polynomial():
        return False
    return sympy.simplify(diff) == 0


def prod(sizes) -> sympy.Expr:
    out = sympy.Integer(1)
    for s in sizes:
        out = out * expr(s)
    return out


def module_path(node: fx.Node) -> str:
    """FQN of the innermost module that produced ``node`` ('' at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in reversed(list(stack.values())):
        if not path.startswith("_empty"):
            return clean_path(path)
    return ""


def module_calls(graph: fx.Graph, fqns) -> tuple[int, ...]:
    """How many times forward called each module of ``fqns``: export keys the
    ``nn_module_stack`` entry of each call after the first with ``@1``, ``@2``, ... One pass
    over the graph, each distinct call read once."""
    calls = {(key, path) for n in graph.nodes
             for key, (path, _type) in (n.meta.get("nn_module_stack") or {}).items()}
    counts = Counter(clean_path(path) for _key, path in calls)
    return tuple(max(counts[f], 1) for f in fqns)


def block_of(node: fx.Node, blocks) -> Optional[str]:
    """The block (one of ``blocks``, module FQNs) ``node`` belongs to, or None: a parameter
    read (get_attr, which carries no module stack) by its target, any other node by
    :func:`module_path`."""
    path = node.target if node.op == "get_attr" else module_path(node)
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return b
    return None


def descendants(node: fx.Node, limit: Optional[int] = None) -> set:
    """``node`` and every node computed from it (the first ``limit`` found, where given)."""
    todo, seen = [node], set()
    while todo and (limit is None or len(seen) < limit):
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(n.users)
    return seen


def clean_path(path: str) -> str:
    """A module path of ``nn_module_stack`` as an FQN."""
    # export spells ModuleList items as "layers.0" already; older releases used "layers[0]"
    return path.replace("[", ".").replace("]", "").replace("L['self'].", "")


def weight_fqn(node: fx.Node) -> Optional[str]:
    """The get_attr target feeding ``node`` directly, if any."""
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def attr_targets(graph: fx.Graph) -> list[str]:
    """Tensors a graph reads with get_attr, in first-use order, without ``runtime_device``."""
    out = []
    for n in graph.nodes:
        if n.op == "get_attr" and n.target != RUNTIME_DEVICE and n.target not in out:
            out.append(n.target)
    return out


def read_attrs(graph: fx.Graph) -> set[str]:
    """Tensors some node of ``graph`` reads (export keeps a get_attr, with no user, for a
    parameter forward never reads)."""
    return {n.target for n in graph.nodes if n.op == "get_attr" and n.users}


def source_line(node: fx.Node, outer: int = 0) -> str:
    """``file.py:line`` of the innermost frame of ``node``'s stack trace outside torch
    (the model code that produced it; ``outer`` = 1: the line that called that code), or ''
    when export recorded none."""
    frames = trace_lines(node.meta.get("stack_trace") or "")
    return frames[outer] if len(frames) > outer else ""
