"""Read-only facts about a captured graph: shapes, module paths, parameter uses."""
from __future__ import annotations

import os
import re
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
    """One linear layer of the graph, found by its algebra: ``y = x W^T (+ b)`` or
    ``y = x W (+ b)`` with W a 2-D parameter (a get_attr), whichever op spells it:
    ``aten.linear(x, W, b)`` (nn.Linear, W (out, in)), ``aten.addmm(b, x, W)`` (GPT-2's
    Conv1D, W (in, out)), ``matmul`` / ``mm`` / ``bmm`` / ``addmm`` with W or a transpose of W
    (``W.T``, ``W.t()``, ``W.transpose(0, 1)``, ``W.permute(1, 0)``) as the right operand, and
    a bias added by a separate ``add`` of a 1-D parameter (Falcon's ``x @ W.T + b``).

    Attributes:
        node: the call_function node of the product.
        x: its input activation.
        weight, bias: get_attr targets (bias None when absent).
        out_dim: the weight dim of the output features (0 for W (out, in), 1 for W (in, out));
            ``1 - out_dim`` is the input-features dim.
        w_node: the node the product reads the weight through (the get_attr or its transpose).
        bias_add: the separate ``add`` of the bias, or None (bias inside the op or absent).
    """

    node: fx.Node
    x: fx.Node
    weight: str
    bias: Optional[str]
    out_dim: int
    w_node: Optional[fx.Node] = None
    bias_add: Optional[fx.Node] = None

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim


_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default,
               aten.mT.default}
_PRODUCTS = {aten.matmul.default, aten.mm.default, aten.bmm.default}


def _param_2d(n) -> bool:
    return bool(weight_fqn(n)) and is_tensor(n) and len(shape(n)) == 2


def _weight_operand(w) -> tuple[Optional[fx.Node], bool]:
    """(get_attr node, transposed) when ``w`` is a 2-D parameter or a transpose of one."""
    if _param_2d(w):
        return w, False
    if isinstance(w, fx.Node) and w.op == "call_function" and w.target in _TRANSPOSES \
            and _param_2d(w.args[0]):
        if w.target is aten.transpose.int and sorted(a % 2 for a in w.args[1:3]) != [0, 1]:
            return None, False
        if w.target is aten.permute.default and [a % 2 for a in w.args[1]] != [1, 0]:
            return None, False
        return w.args[0], True
    return None, False


def _bias_add(n: fx.Node, out_features) -> tuple[Optional[str], Optional[fx.Node]]:
    """A separate ``add(y, b)`` of a 1-D parameter of ``out_features`` as ``n``'s only use."""
    users = list(n.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or len(users[0].args) != 2:
        return None, None
    add = users[0]
    other = add.args[1] if add.args[0] is n else add.args[0]
    if weight_fqn(other) and is_tensor(other) and len(shape(other)) == 1 \
            and same(shape(other)[0], out_features) and not add.kwargs:
        return other.target, add
    return None, None


def as_linear(n: fx.Node) -> Optional[Linear]:
    """``n`` as a :class:`Linear`, or None."""
    if n.op != "call_function":
        return None
    bias = None
    if n.target is aten.linear.default:
        x, w = n.args[0], n.args[1]
        bias = weight_fqn(n.args[2]) if len(n.args) > 2 else None
        if len(n.args) > 2 and n.args[2] is not None and not bias:
            return None
        if not _param_2d(w):
            return None
        return Linear(n, x, w.target, bias, 0, w)
    if n.target is aten.addmm.default and len(n.args) == 3 and not n.kwargs:
        b, x, w = n.args
        if not weight_fqn(b):
            return None
        bias = b.target
    elif n.target in _PRODUCTS and len(n.args) == 2:
        x, w = n.args
    else:
        return None
    param, transposed = _weight_operand(w)
    if param is None or not is_tensor(x) or len(shape(x)) < 2:
        return None
    out_dim = 0 if transposed else 1
    bias_add = None
    if bias is None:
        bias, bias_add = _bias_add(n, shape(param)[out_dim])
    return Linear(n, x, param.target, bias, out_dim, w, bias_add)


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


def source_line(node: fx.Node) -> str:
    """``file.py:line`` of the innermost frame of ``node``'s stack trace outside torch
    (the model code that produced it), or '' when export recorded none."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in path:
            return f"{os.path.basename(path)}:{line}"
    return ""


# ops that keep logits sharded along their last (vocabulary) dim column for column: dtype
# casts, copies, and a scalar scale or softcap (Gemma's tanh(x / c) * c)
_SHARD_KEEPING = {aten.to.dtype, aten._to_copy.default, aten.contiguous.default,
                  aten.clone.default, aten.alias.default, aten.detach.default, aten.tanh.default}
_SCALED = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}


def logits_region(head: fx.Node) -> list[fx.Node]:
    """``head`` (an LM head's logits, sharded along the last dim) and the nodes computed from
    it column for column (:data:`_SHARD_KEEPING`, a multiply or divide by a number, a slice of
    another dim), in graph order: their values are sharded like the head's."""
    region, frontier = {head}, [head]
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u in region or u.op != "call_function" or u.args[0] is not node:
                continue
            keeps = u.target in _SHARD_KEEPING or (
                u.target in _SCALED and len(u.args) == 2 and isinstance(u.args[1], (int, float))) \
                or (u.target is aten.slice.Tensor and is_tensor(u) and len(u.args) > 1
                    and u.args[1] % len(shape(u)) != len(shape(u)) - 1)
            if keeps:
                region.add(u)
                frontier.append(u)
    return [n for n in head.graph.nodes if n in region]
