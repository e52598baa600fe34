"""Element values of index-arithmetic tensors as formulas of their indices (read-only).

A mask built from ``arange``, comparisons, broadcasting views and gathers depends on the
sizes only, never on data; its element at index ``(i0, .., in)`` is then a formula in the
``i``s. ``element_formula`` evaluates a node's producer chain symbolically (sympy, integer
index symbols) for every size at once, so a mask can be *proven* equal to the causal one
(``k <= q``) rather than sampled at the example's sizes. Any op outside the small table
below, or a value read from an input, parameter or buffer, makes the formula unknown
(``None``): the caller then keeps the graph as it is.

Semantics follow the ATen ops (broadcasting from the right, ``index.Tensor`` with the index
tensors covering the leading dims, ``diff`` with ``prepend``, ``cumsum``, ``tril``/``triu``).
"""
from __future__ import annotations

from typing import Callable, Optional

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten
_INT_MAX = 2 ** 63 - 1
MAX_NODES = 200  # a mask chain is a few dozen ops; stop walking long before a whole model


def idx(d: int) -> sympy.Symbol:
    """The index symbol of dim ``d`` of the tensor a formula describes."""
    return sympy.Symbol(f"i{d}", integer=True, nonnegative=True)


class Formula:
    """``expr``: the element at index ``(i0, .., i{r-1})``; ``shape``: ints (1 = a dim that
    broadcasts) or the sympy expression of a symbolic size."""

    def __init__(self, expr, shape):
        self.expr, self.shape = expr, tuple(shape)

    def at(self, out_rank: int, out_shape) -> sympy.Expr:
        """This value broadcast to a result of rank ``out_rank`` (dims aligned right)."""
        off = out_rank - len(self.shape)
        sub = {}
        for d, s in enumerate(self.shape):
            o = out_shape[d + off]
            sub[idx(d)] = sympy.Integer(0) if s == 1 and o != 1 else idx(d + off)
        return self.expr.xreplace(sub)


def _shape(node) -> Optional[tuple]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else s.node.expr for s in val.shape)


def element_formula(node: fx.Node) -> Optional[Formula]:
    """The formula of ``node``'s elements, or None when it is not provably index arithmetic."""
    memo: dict = {}
    try:
        return _eval(node, memo)
    except (_Unknown, TypeError, ValueError, AttributeError):  # sympy refusing a mixed formula
        return None


class _Unknown(Exception):
    pass


def _eval(node, memo) -> Formula:
    if not isinstance(node, fx.Node):
        if isinstance(node, (bool, int)):
            return Formula(sympy.sympify(node), ())
        raise _Unknown(node)
    if node in memo:
        return memo[node]
    if len(memo) > MAX_NODES or node.op != "call_function" or node.target not in _OPS:
        raise _Unknown(node)
    shape = _shape(node)
    if shape is None or _dtype(node) not in _EXACT:
        raise _Unknown(node)  # float values round: only bools and integers are exact formulas
    if node.target in _LOGICAL and any(_dtype(a) is not torch.bool for a in node.all_input_nodes):
        raise _Unknown(node)  # on integers these ops are bitwise
    out = Formula(_OPS[node.target](node, shape, lambda n: _eval(n, memo)), shape)
    memo[node] = out
    return out


def _dtype(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _same_dtype(node) -> bool:
    val, src = node.meta.get("val"), node.args[0].meta.get("val")
    return isinstance(src, torch.Tensor) and val.dtype == src.dtype


# --- factories ---------------------------------------------------------------------------

def _arange(node, shape, ev):
    if node.target is aten.arange.default:
        return idx(0)
    start, step = node.args[0], _arg(node, 2, "step", 1)
    if not isinstance(start, int) or not isinstance(step, int):
        raise _Unknown(node)
    return start + step * idx(0)


def _constant(value_index):
    def rule(node, shape, ev):
        v = 1 if value_index is None else _arg(node, value_index, "fill_value")
        if not isinstance(v, (bool, int)):
            raise _Unknown(node)
        return sympy.sympify(bool(v)) if _dtype(node) is torch.bool else sympy.Integer(v)
    return rule


# --- views --------------------------------------------------------------------------------

def _identity(node, shape, ev):
    if not _same_dtype(node):
        raise _Unknown(node)
    return ev(node.args[0]).expr


def _unsqueeze(node, shape, ev):
    x = ev(node.args[0])
    d = node.args[1] % len(shape)
    return x.expr.xreplace({idx(j): idx(j + 1 if j >= d else j) for j in range(len(x.shape))})


def _expand(node, shape, ev):
    return ev(node.args[0]).at(len(shape), shape)


def _slice(node, shape, ev):
    x = ev(node.args[0])
    dim = _arg(node, 1, "dim", 0) % len(shape)
    start, step = _arg(node, 2, "start", 0), _arg(node, 4, "step", 1)
    start = 0 if start is None else start
    if not isinstance(start, int) or not isinstance(step, int) or start < 0:
        raise _Unknown(node)
    return x.expr.xreplace({idx(dim): start + step * idx(dim)})


def _view(node, shape, ev):
    """Only views that add or drop size-1 dims (the others renumber elements)."""
    x = ev(node.args[0])
    kept = [d for d, s in enumerate(x.shape) if s != 1]
    out = [d for d, s in enumerate(shape) if s != 1]
    if [x.shape[d] for d in kept] != [shape[d] for d in out]:
        raise _Unknown(node)
    sub = {idx(a): idx(b) for a, b in zip(kept, out)}
    sub.update({idx(d): sympy.Integer(0) for d, s in enumerate(x.shape) if s == 1})
    return x.expr.xreplace(sub)


# --- gathers ------------------------------------------------------------------------------

def _index(node, shape, ev):
    """``x[t0, .., tk]``: index tensors for the leading dims, broadcast to one shape ``B``;
    result dims are ``B`` then x's remaining dims."""
    x, indices = ev(node.args[0]), node.args[1]
    if any(t is None or _dtype(t) not in (torch.int64, torch.int32) for t in indices):
        raise _Unknown(node)  # None skips a dim; a bool index selects, it does not gather
    rest = len(x.shape) - len(indices)
    b = len(shape) - rest
    sub = {idx(j): ev(t).at(b, shape[:b]) for j, t in enumerate(indices)}
    if not all(v.is_nonnegative for v in sub.values()):
        raise _Unknown(node)  # a negative index counts from the end
    sub.update({idx(len(indices) + j): idx(b + j) for j in range(rest)})
    return x.expr.xreplace(sub)


# --- elementwise --------------------------------------------------------------------------

def _elementwise(fn: Callable, n: int = 2):
    def rule(node, shape, ev):
        vals = []
        for a in node.args[:n]:
            vals.append(ev(a).at(len(shape), shape) if isinstance(a, fx.Node) else _scalar(a, node))
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            raise _Unknown(node)
        return fn(*vals)
    return rule


def _scalar(a, node):
    if isinstance(a, (bool, int)):
        return sympy.sympify(a)
    raise _Unknown(node)


def _bool(e):
    return e if _is_bool(e) else sympy.Ne(e, 0)


def _compare(relation):
    """A comparison as torch computes it: a bool operand counts as 0 / 1 (sympy alone
    compares ``Ne(i <= j, 0)`` by structure and answers True). (In)equality of a bool with
    the constant 0 or 1 is the bool or its negation, of two bools their equivalence."""
    def compare(a, b):
        if relation in (sympy.Eq, sympy.Ne) and (_is_bool(a) or _is_bool(b)):
            eq = _bool_equality(a, b)
            if eq is not None:
                return eq if relation is sympy.Eq else sympy.Not(eq)
        return relation(_int(a), _int(b))
    return compare


def _is_bool(e) -> bool:
    """A truth value (a sympy Symbol is a Boolean too, but an index symbol is an integer)."""
    return isinstance(e, sympy.logic.boolalg.Boolean) and not isinstance(e, sympy.Expr)


def _bool_equality(a, b):
    """``a == b`` as a Boolean when at least one side is a bool and the other a bool or an
    integer constant; None otherwise (then compared as 0 / 1 integers)."""
    if _is_bool(a) and _is_bool(b):
        return sympy.Equivalent(a, b)
    boolean, other = (a, b) if _is_bool(a) else (b, a)
    other = sympy.sympify(other)
    if not other.is_Integer:
        return None
    return {0: sympy.Not(boolean), 1: boolean}.get(int(other), sympy.false)


def _int(e):
    """bool -> 0/1 (torch's promotion in sums and cumsums)."""
    if e is sympy.true:
        return sympy.Integer(1)
    if e is sympy.false:
        return sympy.Integer(0)
    if _is_bool(e):
        return sympy.Piecewise((1, e), (0, True))
    return e


def _where(node, shape, ev):
    c, a, b = (ev(x).at(len(shape), shape) if isinstance(x, fx.Node) else _scalar(x, node)
               for x in node.args[:3])
    return sympy.Piecewise((a, _bool(c)), (b, True))


def _triangle(lower: bool):
    """tril / triu: elements off the kept triangle of the last two dims become 0 / False."""
    def rule(node, shape, ev):
        x = ev(node.args[0])
        d = _arg(node, 1, "diagonal", 0)
        if len(shape) < 2 or not isinstance(d, int):
            raise _Unknown(node)
        gap = idx(len(shape) - 1) - idx(len(shape) - 2)
        keep = sympy.Le(gap, d) if lower else sympy.Ge(gap, d)
        if _dtype(node) is torch.bool:
            return sympy.And(_bool(x.expr), keep)
        return sympy.Piecewise((x.expr, keep), (0, True))
    return rule


# --- scans --------------------------------------------------------------------------------

def _cumsum(node, shape, ev):
    """cumsum along a dim the value does not depend on: value x (position + 1)."""
    x = ev(node.args[0])
    d = node.args[1] % len(shape)
    e = _int(x.expr)
    if idx(d) in e.free_symbols:
        raise _Unknown(node)
    return e * (idx(d) + 1)


def _diff(node, shape, ev):
    """``diff(x, 1, dim, prepend)``: c = cat(prepend, x) along dim; out[j] = c[j+1] - c[j]."""
    x = ev(node.args[0])
    n, dim = _arg(node, 1, "n", 1), _arg(node, 2, "dim", -1) % len(shape)
    pre, app = _arg(node, 3, "prepend"), _arg(node, 4, "append")
    if n != 1 or app is not None or _dtype(node) is torch.bool:
        raise _Unknown(node)  # diff of bools is xor
    j = idx(dim)
    if pre is None:
        cat = x.expr
        width = 0
    else:
        p = ev(pre)
        width = p.shape[dim]
        if not isinstance(width, int) or len(p.shape) != len(shape):
            raise _Unknown(node)
        cat = sympy.Piecewise((p.expr, j < width), (x.expr.xreplace({j: j - width}), True))
    return sympy.expand(cat.xreplace({j: j + 1}) - cat)


_EXACT = (torch.bool, torch.int64, torch.int32)  # narrower integers wrap around

_OPS = {
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.new_ones.default: _constant(None), aten.ones.default: _constant(None),
    aten.full.default: _constant(1), aten.new_full.default: _constant(2),
    aten.unsqueeze.default: _unsqueeze, aten.expand.default: _expand,
    aten.slice.Tensor: _slice, aten.view.default: _view, aten.reshape.default: _view,
    aten.to.dtype: _identity, aten.to.dtype_layout: _identity, aten._to_copy.default: _identity,
    aten.clone.default: _identity, aten.contiguous.default: _identity,
    aten.alias.default: _identity, aten.detach.default: _identity,
    aten.index.Tensor: _index,
    aten.add.Tensor: _elementwise(lambda a, b: a + b),
    aten.sub.Tensor: _elementwise(lambda a, b: a - b),
    aten.mul.Tensor: _elementwise(lambda a, b: a * b),
    aten.neg.default: _elementwise(lambda a: -a, 1),
    aten.le.Tensor: _elementwise(_compare(sympy.Le)), aten.le.Scalar: _elementwise(_compare(sympy.Le)),
    aten.lt.Tensor: _elementwise(_compare(sympy.Lt)), aten.lt.Scalar: _elementwise(_compare(sympy.Lt)),
    aten.ge.Tensor: _elementwise(_compare(sympy.Ge)), aten.ge.Scalar: _elementwise(_compare(sympy.Ge)),
    aten.gt.Tensor: _elementwise(_compare(sympy.Gt)), aten.gt.Scalar: _elementwise(_compare(sympy.Gt)),
    aten.eq.Tensor: _elementwise(_compare(sympy.Eq)), aten.eq.Scalar: _elementwise(_compare(sympy.Eq)),
    aten.ne.Tensor: _elementwise(_compare(sympy.Ne)), aten.ne.Scalar: _elementwise(_compare(sympy.Ne)),
    aten.__and__.Tensor: _elementwise(lambda a, b: sympy.And(_bool(a), _bool(b))),
    aten.bitwise_and.Tensor: _elementwise(lambda a, b: sympy.And(_bool(a), _bool(b))),
    aten.logical_and.default: _elementwise(lambda a, b: sympy.And(_bool(a), _bool(b))),
    aten.__or__.Tensor: _elementwise(lambda a, b: sympy.Or(_bool(a), _bool(b))),
    aten.bitwise_or.Tensor: _elementwise(lambda a, b: sympy.Or(_bool(a), _bool(b))),
    aten.logical_or.default: _elementwise(lambda a, b: sympy.Or(_bool(a), _bool(b))),
    aten.logical_not.default: _elementwise(lambda a: sympy.Not(_bool(a)), 1),
    aten.bitwise_not.default: _elementwise(lambda a: sympy.Not(_bool(a)), 1),
    aten.tril.default: _triangle(True), aten.triu.default: _triangle(False),
    aten.where.self: _where,
    aten.cumsum.default: _cumsum,
    aten.diff.default: _diff,
}


def is_causal_formula(f: Formula) -> bool:
    """True iff the boolean formula is ``k <= q`` for the last two dims (q = dim -2,
    k = dim -1) and reads no other index: SDPA's ``is_causal`` (``tril(ones(L, S))``)."""
    r = len(f.shape)
    if r < 2:
        return False
    q, k = idx(r - 2), idx(r - 1)
    e = f.expr
    if e.free_symbols - {q, k}:
        return False
    if isinstance(e, (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt)):
        lhs, rhs = (e.lhs, e.rhs) if isinstance(e, (sympy.Le, sympy.Lt)) else (e.rhs, e.lhs)
        gap = lhs - rhs + (1 if isinstance(e, (sympy.Lt, sympy.Gt)) else 0)  # gap <= 0
        return sympy.expand(gap - (k - q)) == 0
    return False


_LOGICAL = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.__or__.Tensor,
            aten.bitwise_or.Tensor, aten.bitwise_not.default}
