"""Read-only facts about a captured graph: shapes, module paths, parameter uses."""
from __future__ import annotations

from typing import NamedTuple, Optional

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
    """Whether two sizes are equal for every value of their symbols.

    ``sympy.simplify`` costs milliseconds per call and the view rule compares thousands of
    sizes on a 70B graph (18 s of a 31 s compile); an expanded polynomial is zero exactly
    when it is identically zero, so simplify is left for FloorDiv/Mod-like expressions.
    """
    diff = sympy.expand(expr(a) - expr(b))
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
            return _clean(path)
    return ""


def _clean(path: str) -> str:
    # export spells ModuleList items as "layers.0" already; older releases used "layers[0]"
    return path.replace("[", ".").replace("]", "").replace("L['self'].", "")


def weight_fqn(node: fx.Node) -> Optional[str]:
    """The get_attr target feeding ``node`` directly, if any."""
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


class Linear(NamedTuple):
    """One linear layer of the graph: ``aten.linear(x, W, b)`` (nn.Linear, W of shape
    (out, in)) or ``aten.addmm(b, x, W)`` (GPT-2's Conv1D, W of shape (in, out)).

    Attributes:
        node: the call_function node.
        x: its input activation.
        weight, bias: get_attr targets (bias None when absent).
        out_dim: the weight dim of the output features (0 for linear, 1 for Conv1D);
            ``1 - out_dim`` is the input-features dim.
    """

    node: fx.Node
    x: fx.Node
    weight: str
    bias: Optional[str]
    out_dim: int

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim


def as_linear(n: fx.Node) -> Optional[Linear]:
    """``n`` as a :class:`Linear`, or None: aten.linear on a 2-D get_attr weight, or
    aten.addmm(bias, x, weight) on a get_attr bias and 2-D weight (transformers' Conv1D)."""
    if n.op != "call_function":
        return None
    if n.target is aten.linear.default:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        out_dim = 0
    elif n.target is aten.addmm.default and len(n.args) == 3 and not n.kwargs:
        b, x, w = n.args
        if not weight_fqn(b):
            return None
        out_dim = 1
    else:
        return None
    if not (weight_fqn(w) and is_tensor(w) and len(shape(w)) == 2):
        return None
    return Linear(n, x, w.target, weight_fqn(b), out_dim)


def linear_sites(graph: fx.Graph) -> list[Linear]:
    """Every linear layer of ``graph`` (see :func:`as_linear`), in graph order."""
    return [s for s in map(as_linear, graph.nodes) if s is not None]


def linear_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of :func:`linear_sites`."""
    return [s.node for s in linear_sites(graph)]


def attr_targets(graph: fx.Graph) -> list[str]:
    """Tensors a graph reads with get_attr, in first-use order, without ``runtime_device``."""
    out = []
    for n in graph.nodes:
        if n.op == "get_attr" and n.target != RUNTIME_DEVICE and n.target not in out:
            out.append(n.target)
    return out
