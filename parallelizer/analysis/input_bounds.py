"""The batch and sequence sizes the model's code accepts: bounds a run would otherwise meet
inside a forward on every rank.

Two sources, both read from the captured graph: torch.export's range for an input's symbol
(``ShapeEnv.var_to_range``: a learned position table of 16 rows sliced by the length,
``self.pos[:, :T]``, guards ``T <= 16``; so does nanoGPT's ``assert t <= block_size``), and an
embedding looked up with positions computed from the length (GPT-2's ``wpe(arange(T))``, OPT's
``cumsum(mask) - 1 + 2``): export sees no guard there (the index is data), and a longer
sequence is an index error on CPU and a device-side assert on CUDA.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from .graph_facts import input_values, source_line

aten = torch.ops.aten

# ops that move or copy index values, all of them, without changing them
_KEEPS = {aten.unsqueeze.default, aten.expand.default, aten.view.default,
          aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
          aten.clone.default, aten.contiguous.default, aten.squeeze.dim, aten.repeat.default}


def size_ranges(gm: fx.GraphModule, input_names) -> tuple:
    """``(input name, dim, low, high, where)`` for dim 0 (batch) and dim 1 (sequence) of each
    input whose symbol the model's code bounds. ``high``: None where unbounded; listed only
    when ``high`` is a number or ``low`` exceeds 2 (export assumes 2 for every symbol).
    ``where``: ``OP at FILE:LINE`` of the op that bounds it, where found, else ""."""
    looked_up = _embedding_bounds(gm)
    out = []
    for name, val in input_values(gm, input_names):
        for d in range(min(val.dim(), 2)):
            size = val.shape[d]
            if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
                continue
            symbol = size.node.expr
            bound = size.node.shape_env.var_to_range.get(symbol)
            low = int(bound.lower) if bound is not None else 2
            high = int(bound.upper) if bound is not None and bound.upper.is_Integer else None
            where = _sliced_by(gm, symbol, high) if high is not None else ""
            if symbol in looked_up and (high is None or looked_up[symbol][0] < high):
                high, where = looked_up[symbol]
            if high is not None or low > 2:
                out.append((name, d, low, high, where))
    return tuple(out)


def _sliced_by(gm: fx.GraphModule, symbol, high: int) -> str:
    """``OP at FILE:LINE`` of the first op of the model's code given a size computed from
    ``symbol`` and a tensor with a dim of ``high`` (the table a slice is cut from), else ""."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not source_line(n):
            continue
        args = [a for a in n.args if isinstance(a, fx.Node)]
        sized = any(symbol in _expr(a).free_symbols for a in args if _expr(a) is not None)
        table = any(isinstance(a.meta.get("val"), torch.Tensor)
                    and high in [int(str(s)) for s in a.meta["val"].shape if str(s).isdigit()]
                    for a in args)
        if sized and table:
            return f"{n.target} at {source_line(n)}"
    return ""


def _expr(x):
    """The sympy expression of a SymInt node or an int, else None."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return sympy.Integer(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _embedding_bounds(gm: fx.GraphModule) -> dict:
    """``{symbol: (high, where)}``: the largest ``symbol`` whose position ids stay inside the
    rows of the table they index (``symbol + c - 1 < rows``), the tightest one per symbol:
    an embedding's, or a tensor's dim indexed by them (``aten.index.Tensor``: a learned
    relative-position table ``rel[:, (pos[None, :] - pos[:, None]) + 15]`` of 31 columns
    runs lengths up to 16, and a longer one was an IndexError inside the forward, zoo 24 F4)."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.embedding.default:
            looked = [(n.args[1], n.args[0].meta["val"].shape[0])]
        elif n.target is aten.index.Tensor:
            table = n.args[0].meta["val"].shape
            looked = [(i, table[d]) for d, i in enumerate(n.args[1]) if isinstance(i, fx.Node)]
        else:
            continue
        for ids, rows in looked:
            _tightest(out, _largest(ids), rows, n)
    return out


def _tightest(out: dict, top, rows, n: fx.Node) -> None:
    """Record in ``out`` the bound ids reaching ``top`` (one symbol plus a number) put on
    their symbol, looked up in ``rows`` rows by ``n``, where it is the tightest."""
    if top is None or len(top.free_symbols) != 1 or not str(rows).isdigit():
        return
    symbol = next(iter(top.free_symbols))
    offset = sympy.expand(top - symbol)  # the ids reach symbol + offset
    if not offset.is_Integer or sympy.expand(top - symbol - offset) != 0:
        return
    high = int(rows) - 1 - int(offset)
    if symbol not in out or high < out[symbol][0]:
        where = source_line(n)
        out[symbol] = (high, f"{n.target} of {int(rows)} rows at {where}" if where else "")


def _largest(node, depth: int = 12):
    """The largest integer value of ``node``, exactly, as an expression of the input symbols,
    for values built from ``arange`` / ``ones`` / ``cumsum`` of ones by copies, views, whole
    slices and adding, subtracting or multiplying by a number (or by ones); else None. Exact,
    not a bound: a refusal must never turn away a length the model runs (``wpe(arange(T)[:16])``
    runs any ``T``, so a partial slice gives None)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or depth == 0:
        return None
    t, args = node.target, node.args
    if t in _KEEPS or (t is aten.slice.Tensor and _whole(args)):
        return _largest(args[0], depth - 1)
    if t is aten.arange.default:
        end = _expr(args[0])
        return end - 1 if end is not None else None
    if t in (aten.arange.start, aten.arange.start_step) and (len(args) < 3 or args[2] == 1):
        end = _expr(args[1])
        return end - 1 if end is not None else None
    if _is_ones(node):
        return sympy.Integer(1)
    if t is aten.cumsum.default and _is_ones(args[0]):
        return _expr(node.meta["val"].shape[args[1]])
    if t in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 \
            and all(isinstance(a, fx.Node) for a in args):
        return _outer(node, depth)
    if t in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor) and len(args) == 2:
        a, b = args
        if t is aten.mul.Tensor and _is_ones(a):
            a, b = b, a
        if t is aten.mul.Tensor and _is_ones(b):
            return _largest(a, depth - 1)
        number = _expr(b) if not isinstance(b, fx.Node) else None
        top = _largest(a, depth - 1)
        if top is None or number is None:
            return None
        if t is aten.add.Tensor:
            return top + number
        if t is aten.sub.Tensor:
            return top - number
        return top * number if number.is_nonnegative else None
    return None


def _outer(node, depth: int):
    """The largest value of ``a + b`` or ``a - b`` where the two vary along different dims
    (``pos[None, :] - pos[:, None]``: every pair of positions is in the result, so the
    largest is ``max(a) - min(b)``, reached); None where they share a dim (``pos - pos`` is
    0 everywhere), or where either is unknown."""
    a, b = node.args
    if not _apart(a, b):
        return None
    top = _largest(a, depth - 1)
    other = _largest(b, depth - 1) if node.target is aten.add.Tensor else _smallest(b, depth - 1)
    if top is None or other is None:
        return None
    return top + other if node.target is aten.add.Tensor else top - other


def _apart(a: fx.Node, b: fx.Node) -> bool:
    """``a`` and ``b`` broadcast against each other along disjoint dims: no dim over 1 in
    both (their shapes aligned from the last dim)."""
    sa, sb = (getattr(x.meta.get("val"), "shape", None) for x in (a, b))
    if sa is None or sb is None:
        return False
    big = [{len(s) - i for i, d in enumerate(s) if not (str(d).isdigit() and int(str(d)) == 1)}
           for s in (sa, sb)]
    return not big[0] & big[1]


def _smallest(node, depth: int = 12):
    """The smallest value of ``node``, exactly: of ``arange`` (its start) through copies and
    views, plus or minus a number; else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or depth == 0:
        return None
    t, args = node.target, node.args
    if t in _KEEPS or (t is aten.slice.Tensor and _whole(args)):
        return _smallest(args[0], depth - 1)
    if t is aten.arange.default:
        return sympy.Integer(0)
    if t in (aten.arange.start, aten.arange.start_step) and (len(args) < 3 or args[2] == 1):
        return _expr(args[0])
    if t in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 \
            and not isinstance(args[1], fx.Node):
        low, number = _smallest(args[0], depth - 1), _expr(args[1])
        if low is None or number is None:
            return None
        return low + number if t is aten.add.Tensor else low - number
    return None


def _is_ones(x) -> bool:
    return isinstance(x, fx.Node) and x.op == "call_function" and x.target in (
        aten.ones.default, aten.ones_like.default)


def _whole(args) -> bool:
    """A slice's arguments keep every element (export's ``x[:, :]``: start 0, end max)."""
    start = args[2] if len(args) > 2 else 0
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return start in (0, None) and step == 1 and (
        end is None or (isinstance(end, int) and end >= 2 ** 62))
