"""How tensor parallelism can split the FFN dim of one expert layer (facts, no decision).

An expert layer's region (:mod:`parallelizer.analysis.experts`) is the grouped matmuls and the
row-wise ops between them: ``h = x @ W_gate_up[e]`` (S, N), a cut of ``h`` into gate | up
along its features, an activation and a product, ``y = a @ W_down[e]`` (S, H). Megatron's
MLP split (Shoeybi et al. 2019, §3) applies to every expert at once:

- the **first** grouped matmuls (their rows come from outside the region) are column
  parallel: each tp rank holds its block of their output features (the FFN dim), as a
  :class:`~parallelizer.plan.layouts.Fused` piece when the region cuts that dim into parts
  (``chunk`` / ``split`` / ``slice`` of gate | up), so each rank's local cut still gives its
  own gate rows and its own up rows;
- the **last** grouped matmuls (their rows come from inside) are row parallel along the
  dim they contract, so their outputs are Partial sums over tp.

:func:`expert_ffn` reads which weight dim that is (through the transposes the model applies
before the matmul), the parts each column weight's dim is cut into, and every explicit size
along the FFN dim inside the region (a ``split`` size, ``slice`` bounds) that a tp rank must
see divided by tp. Anything else in the region that reads the features as a whole (a bias
added to them, a strided slice, a value of another width) is a ``blocker`` naming the op and
the model's source line: the planner keeps that layer's experts replicated over tp.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from .experts import full_row_slice
from .graph_facts import aten, is_tensor, shape, source_line

_PERMUTES = {aten.transpose.int, aten.permute.default}
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.contiguous.default, aten.alias.default,
          aten.clone.default}
_BIG = 2 ** 62  # a slice's "to the end" (export writes sys.maxsize)


@dataclass
class ExpertFFN:
    """The tp split of one expert layer's FFN dim.

    Attributes:
        column: weight fqn -> the dim of the (E, a, b) weight holding the first matmul's
            output features (the FFN dim, 2F for a fused gate | up).
        row: weight fqn -> the dim the last matmul contracts (F).
        parts: column weight fqn -> the sizes its FFN dim is cut into by the region, in
            order (one part: not cut).
        sizes: ``(node, arg index, list index or None, global size)`` of every size along the
            FFN dim in the region (rewritten to ``size / tp``).
        widths: weight fqn -> the length of its FFN dim.
        biases: bias fqn -> ``(column weight fqn, bias dim)``: a bias added to that weight's
            whole output, split along ``dim`` as the weight's FFN dim is (a per-expert bias
            (E, N) gathered by expert ``bias[expert_ids]``: dim 1; one (N,) for all: dim 0).
        bias_rows: the region's inputs that are those biases' rows (each tp rank's block of
            the features already: no f on them).
        strides: column weight fqn -> the step of the strided slices that take its output's
            interleaved parts (GPT-OSS's ``gate_up[..., ::2]``, ``[..., 1::2]``): each rank's
            contiguous block holds whole groups of ``step`` when tp x step divides the width.
        blocker: why tp cannot split the layer ('' when it can): op, source line, reason.
    """

    column: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)
    sizes: list = field(default_factory=list)
    widths: dict = field(default_factory=dict)
    biases: dict = field(default_factory=dict)
    bias_rows: set = field(default_factory=set)
    strides: dict = field(default_factory=dict)
    blocker: str = ""


class _Blocked(Exception):
    pass


def expert_ffn(graph: fx.Graph, layer) -> ExpertFFN:
    """The FFN-dim facts of ``layer`` (an :class:`~parallelizer.analysis.experts.ExpertLayer`
    of ``graph``); ``blocker`` set when tp cannot split it."""
    facts = ExpertFFN()
    by_name = {n.name: n for n in graph.nodes}
    region = [by_name[n] for n in layer.region]
    try:
        info = _matmuls(facts, [by_name[m] for m in layer.matmuls], set(region),
                        set(layer.weights))
        origin = _walk(facts, region, set(region), info)
        _check_outputs([by_name[n] for n in layer.outputs], origin)
    except _Blocked as e:
        return ExpertFFN(blocker=str(e))
    return facts


def _where(n: fx.Node) -> str:
    line = source_line(n)
    return f"{n.target} ({n.name}){' at ' + line if line else ''}"


def _weight_operand(mm: fx.Node, weights: set) -> tuple[fx.Node, fx.Node, list]:
    """(rows operand, get_attr of the stacked weight, perm): dim ``i`` of the (E, K, N) operand
    the matmul reads is dim ``perm[i]`` of the weight (through transposes and casts)."""
    for a in mm.all_input_nodes:
        chain, n = [], a
        while n.op == "call_function" and (n.target in _PERMUTES or n.target in _CASTS):
            chain.append(n)
            n = n.args[0]
        if n.op == "get_attr" and n.target in weights:
            perm = [0, 1, 2]
            for v in reversed(chain):
                if v.target is aten.transpose.int:
                    i, j = (d % 3 for d in v.args[1:3])
                    perm[i], perm[j] = perm[j], perm[i]
                elif v.target is aten.permute.default:
                    perm = [perm[d % 3] for d in v.args[1]]
            rows = [r for r in mm.all_input_nodes if r is not a and is_tensor(r)
                    and len(shape(r)) == 2]
            return rows[0], n, perm
    raise _Blocked(f"{_where(mm)}: its stacked weight is not read through transposes only")


def _matmuls(facts: ExpertFFN, mms: list, region: set, weights: set) -> dict:
    """mm -> (rows, weight fqn); column / row weights recorded by where their rows come from."""
    info = {}
    for mm in mms:
        rows, attr, perm = _weight_operand(mm, weights)
        w = attr.target
        info[mm] = (rows, w)
        if rows in region:
            facts.row[w] = perm[1]  # contracts K of (E, K, N)
        else:
            facts.column[w] = perm[2]  # its output features N
        facts.widths[w] = int(shape(attr)[perm[1] if rows in region else perm[2]])
    if not facts.column or not facts.row or set(facts.column) & set(facts.row):
        raise _Blocked(f"{_where(mms[0])}: the grouped matmuls are not a first (column) and a "
                       f"last (row) projection")
    return info


def _walk(facts: ExpertFFN, region: list, members: set, info: dict) -> dict:
    """node -> its place in the FFN features: ``(w, lo, hi)`` the columns ``[lo, hi)`` of
    column weight ``w``'s output, ``("*", 0, width)`` an elementwise result of several, a
    list of those for a chunk / split. Records the cuts as parts and sizes; raises
    _Blocked on an op tp cannot split."""
    origin: dict = {}
    cuts: dict = {}
    for n in region:
        if n in info:
            rows, w = info[n]
            if w in facts.column:
                origin[n] = (w, 0, shape(n)[1])
            elif not isinstance(origin.get(rows), tuple):
                raise _Blocked(f"{_where(n)}: its rows are not computed from the first projection")
        elif n.target is operator.getitem:
            src = origin.get(n.args[0])
            if not isinstance(src, list):
                raise _Blocked(f"{_where(n)}: an item of a value tp does not cut")
            origin[n] = src[n.args[1]]
        elif full_row_slice(n) and isinstance(origin.get(n.args[0]), tuple):
            origin[n] = origin[n.args[0]]
        elif n.target in _CUTS:
            origin[n] = _cut(facts, n, origin, cuts)
        else:
            origin[n] = _elementwise(facts, n, members, origin)
    for w in facts.column:
        if w in cuts and w in facts.strides:
            raise _Blocked(f"{w}'s output features are cut both into blocks and by a strided "
                           f"slice")
        facts.parts[w] = _parts(w, cuts[w]) if w in cuts else None
    return origin


def _elementwise(facts: ExpertFFN, n: fx.Node, members: set, origin: dict) -> tuple:
    ins = [a for a in n.all_input_nodes if a in members]
    for a in n.all_input_nodes:  # operands from outside: per-row scalars, or a bias
        if a not in members and is_tensor(a) and a.meta["val"].numel() > 1 and \
                (len(shape(a)) < 2 or shape(a)[-1] != 1) and not _bias(facts, n, a, ins, origin):
            raise _Blocked(f"{_where(n)}: reads {a.name} {list(shape(a))} across the FFN "
                           f"features (each tp rank holds only its block of them)")
    if not ins or any(a not in origin or isinstance(origin[a], list) for a in ins) or \
            not is_tensor(n) or len(shape(n)) != 2:
        raise _Blocked(f"{_where(n)}: not an elementwise op on (rows, features)")
    widths = {int(shape(a)[1]) for a in ins} | {int(shape(n)[1])}
    if len(widths) != 1:
        raise _Blocked(f"{_where(n)}: combines features of different widths {sorted(widths)}")
    return origin[ins[0]] if len(ins) == 1 else ("*", 0, widths.pop())


def _bias(facts: ExpertFFN, n: fx.Node, a: fx.Node, ins: list, origin: dict) -> bool:
    """``a`` is a bias that ``n`` (an add) adds to a column weight's whole output, a parameter
    read through casts: (N,) as it is, or (E, N) gathered along its experts dim
    (``bias[expert_ids]``: any rows, its features dim stays dim 1). Recorded in
    ``facts.biases``; False (not a bias) otherwise."""
    if n.target not in (aten.add.Tensor, aten.add_.Tensor) or len(ins) != 1 \
            or not isinstance(origin.get(ins[0]), tuple) or origin[ins[0]][0] == "*":
        return False
    w, lo, hi = origin[ins[0]]
    width = facts.widths[w]
    src, dim = _through_casts(a), 0
    if src.target is aten.index.Tensor and len(src.args[1]) == 1 and len(shape(src.args[0])) == 2:
        src, dim = _through_casts(src.args[0]), 1
    if (lo, hi) != (0, width) or src.op != "get_attr" or len(shape(src)) != dim + 1 \
            or shape(src)[dim] != width or shape(a)[-1] != width:
        return False
    facts.biases[src.target] = (w, dim)
    facts.bias_rows.add(a.name)
    return True


def _through_casts(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and n.target in _CASTS:
        n = n.args[0]
    return n


_CUTS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default,
         aten.slice.Tensor, aten.narrow.default}


def _cut(facts: ExpertFFN, n: fx.Node, origin: dict, cuts: dict):
    src = origin.get(n.args[0])
    if not isinstance(src, tuple) or src[0] == "*" or (src[1], src[2]) != (0, facts.widths[src[0]]):
        raise _Blocked(f"{_where(n)}: cuts features that are not one projection's whole output")
    w, _, width = src
    if _dim(n) % 2 != 1:
        raise _Blocked(f"{_where(n)}: cuts along the rows")
    t = n.target
    if t is aten.chunk.default:
        step = -(-width // n.args[1])
        spans = [(i, min(i + step, width)) for i in range(0, width, step)]
    elif t is aten.split.Tensor:
        size = n.args[1]
        spans = [(i, min(i + size, width)) for i in range(0, width, size)]
        facts.sizes.append((n.name, 1, None, size))
    elif t is aten.split_with_sizes.default:
        spans, lo = [], 0
        for i, s in enumerate(n.args[1]):
            spans.append((lo, lo + s))
            facts.sizes.append((n.name, 1, i, s))
            lo += s
    elif _step(n) != 1:
        return _strided(facts, n, w, width)
    else:
        spans = [_interval(facts, n, width)]
    cuts.setdefault(w, []).extend(spans)
    pieces = [(w, lo, hi) for lo, hi in spans]
    return pieces[0] if t in (aten.slice.Tensor, aten.narrow.default) else pieces


def _dim(n: fx.Node) -> int:
    i = 1 if n.target in (aten.slice.Tensor, aten.narrow.default) else 2
    return n.args[i] if len(n.args) > i else n.kwargs.get("dim", 0)


def _step(n: fx.Node) -> int:
    return (n.args[4] or 1) if n.target is aten.slice.Tensor and len(n.args) > 4 else 1


def _strided(facts: ExpertFFN, n: fx.Node, w: str, width: int) -> tuple:
    """A slice taking every ``step``-th feature from an offset below ``step`` to the end (the
    gate and up of an interleaved gate_up): on each rank's contiguous block, whose start is a
    multiple of ``step``, the same slice takes that block's share (checked by the planner:
    tp x step divides the width)."""
    step, lo, hi = n.args[4], n.args[2] or 0, n.args[3]
    if not isinstance(step, int) or not isinstance(lo, int) or not 0 <= lo < step \
            or not (hi is None or isinstance(hi, int) and hi >= width) \
            or facts.strides.get(w, step) != step or width % step:
        raise _Blocked(f"{_where(n)}: a strided slice of the features (step {step}) that "
                       f"does not take every step-th one from the start to the end")
    facts.strides[w] = step
    return ("*", 0, width // step)


def _interval(facts: ExpertFFN, n: fx.Node, width: int) -> tuple[int, int]:
    """[lo, hi) of a slice / narrow along the features; its bounds recorded as sizes."""
    args = list(n.args) + [None] * 5
    if n.target is aten.narrow.default:
        lo, length = args[2], args[3]
        if not isinstance(lo, int) or not isinstance(length, int):
            raise _Blocked(f"{_where(n)}: a cut of the features by a size known at run time only")
        facts.sizes += [(n.name, 2, None, lo), (n.name, 3, None, length)]
        return lo, lo + length
    lo, hi = args[2] or 0, args[3]  # a strided slice went to _strided
    if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
        raise _Blocked(f"{_where(n)}: a cut of the features by a size known at run time only")
    lo = lo + width if lo < 0 else lo
    end = width if hi is None or hi >= _BIG else (hi + width if hi < 0 else min(hi, width))
    if lo:
        facts.sizes.append((n.name, 2, None, lo))
    if hi is not None and hi < _BIG:
        facts.sizes.append((n.name, 3, None, hi))
    return lo, end


def _parts(w: str, spans: list) -> tuple:
    """The part sizes the cuts of ``w``'s output tile it into, in order."""
    spans = sorted(set(spans))
    lo = 0
    for a, b in spans:
        if a != lo:
            raise _Blocked(f"the cuts of {w}'s output features {spans} do not tile them")
        lo = b
    return tuple(b - a for a, b in spans)


def _check_outputs(outputs: list, origin: dict) -> None:
    for y in outputs:
        if y in origin:
            raise _Blocked(f"{_where(y)}: the FFN features leave the expert region before the "
                           f"last (row) projection")
