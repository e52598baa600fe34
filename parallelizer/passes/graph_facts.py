"""Read-only facts about a captured graph: shapes, module paths, parameter uses."""
from __future__ import annotations

from typing import Optional

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

# the emitted modules' device attribute (cleanup pass): read with get_attr, not a tensor
RUNTIME_DEVICE = "runtime_device"


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def expr(x) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression, for exact symbolic comparison."""
    if isinstance(x, sympy.Expr):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def same(a, b) -> bool:
    return sympy.simplify(expr(a) - expr(b)) == 0


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
            return _clean(path)
    return ""


def _clean(path: str) -> str:
    # export spells ModuleList items as "layers.0" already; older releases used "layers[0]"
    return path.replace("[", ".").replace("]", "").replace("L['self'].", "")


def weight_fqn(node: fx.Node) -> Optional[str]:
    """The get_attr target feeding ``node`` directly, if any."""
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def linear_nodes(graph: fx.Graph) -> list[fx.Node]:
    """aten.linear calls whose weight is a 2-D parameter read with get_attr."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            w = n.args[1]
            if weight_fqn(w) and is_tensor(w) and len(shape(w)) == 2:
                out.append(n)
    return out


def attr_targets(graph: fx.Graph) -> list[str]:
    """Tensors a graph reads with get_attr, in first-use order, without ``runtime_device``."""
    out = []
    for n in graph.nodes:
        if n.op == "get_attr" and n.target != RUNTIME_DEVICE and n.target not in out:
            out.append(n.target)
    return out
