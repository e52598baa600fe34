"""Redistribution where no sharded rule takes a value as it is.

DTensor meets an op whose strategies cannot take its inputs' placements by redistributing
them first (torch 2.13, torch/distributed/tensor/_dispatch.py ``redistribute_local_args``),
and a Partial output by reducing it when a replicated value is needed. Propagation does the
same at compile time instead of giving up on the layer group (issue 23 part 2): a conflict
at an op asks the next run (:func:`parallelizer.planning.tp_candidates._settle`) for

- ``Shard(d) -> Replicate``: an all-gather along ``d`` on that edge (the op then runs on the
  whole value, as eager does, on every rank; backward keeps the rank's slice);
- ``Replicate -> Shard(d)``: each rank keeps its block of a replicated value on that edge
  (no communication forward; backward all-gathers the gradient);
- ``Replicate -> CopiedHeads(d, K)``: each rank keeps the one of the K kv heads its query
  heads read (tp a multiple of K; backward all-gathers the gradient and sums each head's
  copies), where attention's query heads are sharded and its kv side was computed whole;
- ``Replicate -> LaidOut(d, key)``: each rank keeps its piece under a column linear's layout
  (its block of each part of a fused q|k|v; backward all-gathers the gradient and places each
  rank's piece), for a bias computed in forward and handed to that linear;
- a ``Partial(sum | avg)`` output (a mean over the sharded dim: an RMS norm over a sharded
  projection): an all-reduce right after the op.

What to redistribute is DTensor's answer where it has a strategy (its choice minimises the
redistribution's cost, torch/distributed/tensor/_ops/utils.py ``generate_redistribute_costs``:
a cut is free, a gather costs the bytes moved), else every sharded input is gathered. A
value that is not an even split of the global tensor (copied kv heads, a piece of a fused
q|k|v) cannot be gathered by a concatenation (a (batch, heads) merge is: its blocks
interleave along the heads): its layer group is
then kept replicated, as before. The requests are keyed by node name and applied on the
edge only while the producer is still placed as the request assumed (a group kept
replicated later turns its gathers off); ``applied`` records what the settled run used.
"""
from __future__ import annotations

import contextlib
import operator

import torch.fx as fx

from ...plan.layouts import InterleavedHeads
from ...frontend.graph_rewrite import returns_view, written_inputs
from ..graph_facts import aten, expr, is_tensor, module_path, shape
from .dtensor import Wants, dtensor_rule, tensor_args
from .placements import REPLICATE, CopiedHeads, LaidOut, Shard
from .state import HeadsMark, add_constraint, dim_of, inputs_of, placement, record_use

_REDUCIBLE = ("sum", "avg")


@contextlib.contextmanager
def seen(node: fx.Node, prop):
    """Within the block ``node``'s inputs are placed as ``node`` reads them (its gathered
    and cut edges of ``prop.edges``)."""
    edges = prop.edges.get(node.name)
    if not edges:
        yield
        return
    by_name = {a.name: a for a in inputs_of(node)}
    gathers = {n for n, w in edges.items() if w == REPLICATE and n in by_name
               and gatherable(by_name[n], prop)}
    # a cut exists to meet a sharded input: with none left (its layer group kept
    # replicated since) it would shard a replicated op
    meets = any(placement(prop, b) != REPLICATE for b in by_name.values()
                if is_tensor(b) and b.name not in gathers)
    saved = {}
    for name, want in edges.items():
        a = by_name.get(name)
        if a is None or (name not in gathers and not (meets and placement(prop, a) == REPLICATE)):
            continue
        saved[name] = (prop.placements.get(name), prop.groups.get(name), prop.heads.get(name),
                       prop.raw.get(name))
        if want == REPLICATE:
            for w in prop.raw.get(name, ()):  # the gather reassembles the even split
                record_use(prop, {w}, None, node)
            prop.groups[name] = frozenset()
        elif isinstance(want, CopiedHeads):  # the reader sees copied kv heads
            prop.heads[name] = HeadsMark(frozenset(), want.heads, True)
        elif isinstance(want, LaidOut):  # the reader sees a piece, as the linear's bias is
            prop.raw[name] = frozenset({want.key})
        else:
            add_constraint(prop, int(expr(shape(a)[want.dim])), "elements", module_path(node),
                           f"dim {want.dim} of {name}, cut to each rank's block for "
                           f"{node.target}")
        prop.placements[name] = Shard(want.dim) if isinstance(want, (CopiedHeads, LaidOut)) \
            else want
        prop.applied.setdefault(node.name, {})[name] = want
    try:
        yield
    finally:
        for name, (p, g, mark, raw) in saved.items():
            prop.placements[name] = p
            prop.groups[name] = g
            _restore(prop.heads, name, mark)
            _restore(prop.raw, name, raw)


def _restore(table: dict, name: str, value) -> None:
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value


def gatherable(a: fx.Node, prop) -> bool:
    """``a`` is an even split of its global value along one dim, so a concatenation of the
    ranks' pieces in rank order is the value itself."""
    p = placement(prop, a)
    if type(p) is not Shard or not is_tensor(a):
        return False
    if a.name in prop.strided and not _merged_evenly(a, p.dim, prop.strided[a.name]):
        return False
    mark = prop.heads.get(a.name)
    if mark is not None and (mark.replicated or mark.expanded):
        return False
    return not _piece(a, prop, {})


_CUTS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
         aten.unbind.int, aten.slice.Tensor, aten.index.Tensor, aten.select.int,
         aten.narrow.default}


def _piece(a: fx.Node, prop, memo: dict) -> bool:
    """``a`` holds the rank's piece of a fused q|k|v (each rank's q | k | v parts side by
    side), not a block of a global tensor: the output of a linear with a non-even layout
    (or its view into heads) and what is computed from it before an op cuts the parts."""
    if a.name in memo:
        return memo[a.name]
    memo[a.name] = False
    if a.name in prop.head_raw or any(_uneven(prop.layouts.get(w))
                                      for w in prop.raw.get(a.name, ())):
        memo[a.name] = True
    elif not _cut(a, prop):
        # copied kv heads read by attention (or repeat_kv) leave the query heads' even split
        memo[a.name] = any(_piece(b, prop, memo) for b in inputs_of(a)
                           if is_tensor(b) and type(placement(prop, b)) is Shard
                           and not _copies(prop, b))
    return memo[a.name]


def _copies(prop, b) -> bool:
    mark = prop.heads.get(b.name)
    return mark is not None and (mark.replicated or mark.expanded)


def _uneven(layout) -> bool:
    """A layout whose rank pieces are not the even split's blocks (interleaved_heads is the
    even split, recorded for converters)."""
    return layout is not None and not isinstance(layout, InterleavedHeads)


def _cut(a: fx.Node, prop) -> bool:
    """``a`` is a part cut out of its input along the input's sharded dim (a split's item,
    a slice, an index)."""
    src = a.args[0] if a.target is operator.getitem else a
    if not isinstance(src, fx.Node) or src.target not in _CUTS or not src.args:
        return False
    x = src.args[0]
    d = dim_of(prop, x)
    if d is None:
        return False
    if src.target is aten.index.Tensor:
        idx = src.args[1]
        return d < len(idx) and idx[d] is not None
    dim = src.args[1] if len(src.args) > 1 and src.target in _DIM_AT_1 else \
        src.kwargs.get("dim", src.args[2] if len(src.args) > 2 else 0)
    return isinstance(dim, int) and dim % len(shape(x)) == d


_DIM_AT_1 = {aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.unbind.int}


def _merged_evenly(a, dim: int, inner: int) -> bool:
    """A (outer, inner) merged dim whose inner factor (global ``inner``) is sharded: the
    gather interleaves the ranks' blocks along it (runtime/tp.py gather_from_tp_dim)."""
    size = expr(shape(a)[dim])
    return bool(size.is_number) and int(size) % inner == 0


def request(node: fx.Node, prop, tp: int, answer=None) -> bool:
    """Ask the next run to redistribute so that ``node`` takes its inputs: as DTensor's
    strategy would (``answer``, a rule's conflict, when it is DTensor's :class:`~.dtensor.Wants`;
    else DTensor is asked), or by a gather of every sharded input. False when no
    redistribution can do it (the caller then keeps the layer group replicated)."""
    copied = any(prop.heads[a.name].replicated for a in inputs_of(node) if a.name in prop.heads)
    if copied and not isinstance(answer, Wants):
        return False  # copied kv heads: a "Shard" each rank holds whole, DTensor cannot say
    # (a Wants beside copied heads is our rule's: attention cutting a whole k to its copies)
    wants = answer if isinstance(answer, Wants) else dtensor_rule(node, prop, tp)
    if isinstance(wants, Wants) and _ask(node, prop, wants):
        return True
    return not copied and gather_all(node, prop)


def cut_copies(node: fx.Node, prop, wants: Wants, heads: int) -> bool:
    """DTensor's answer for ``node`` over a mesh of ``heads`` ranks (copied kv heads, see
    propagate._on_copies) that cuts replicated operands along a dim of ``heads`` entries
    (Cohere's per-head k_norm weight, (kv heads, head_dim)): on the tp mesh each such operand
    is cut to the copies (:class:`CopiedHeads`). False for any other redistribution."""
    changes = {}
    args = tensor_args(node)
    if len(args) != len(wants.inputs):
        return False
    for a, want in zip(args, wants.inputs):
        p = placement(prop, a)
        if p == want:
            continue
        if p != REPLICATE or type(want) is not Shard or not _static(a, want.dim) \
                or int(expr(shape(a)[want.dim])) != heads:
            return False
        changes[a] = CopiedHeads(want.dim, heads)
    return bool(changes) and _edges(node, prop, changes)


def gather_all(node: fx.Node, prop, only=None) -> bool:
    """All-gather every sharded tensor input of ``node`` (of ``only``, when given: a linear's
    activation, never its weight, whose shard is the linear's role), False if one cannot be."""
    sharded = [a for a in (inputs_of(node) if only is None else only)
               if is_tensor(a) and placement(prop, a) != REPLICATE]
    if not sharded or not all(gatherable(a, prop) for a in sharded):
        return False
    return _edges(node, prop, {a: REPLICATE for a in sharded})


def cut(node: fx.Node, prop, a: fx.Node, dim: int) -> bool:
    """``node`` reads the replicated ``a`` as each rank's block along ``dim`` (False for a
    dim whose size is not known at compile time: tp's division of it cannot be checked)."""
    return _static(a, dim) and _edges(node, prop, {a: Shard(dim)})


def lay_out(node: fx.Node, prop, a: fx.Node, dim: int, key: str) -> bool:
    """``node`` reads the replicated ``a`` as each rank's piece of ``dim`` under the layout of
    the column linear ``key`` (:class:`LaidOut`: a bias computed in forward for a fused
    q|k|v, cut as the linear's own bias parameter would be)."""
    return _static(a, dim) and _edges(node, prop, {a: LaidOut(dim, key)})


def _static(a: fx.Node, dim: int) -> bool:
    """``a`` has a dim ``dim`` of a size known at compile time (a legacy empty 1-D tensor
    that ``torch.cat`` accepts beside n-D ones has no such dim: XLM's empty kv cache)."""
    s = shape(a)
    return -len(s) <= dim < len(s) and expr(s[dim]).is_number


def _ask(node, prop, wants: Wants) -> bool:
    changes = {}
    args = tensor_args(node)
    if wants.inputs and len(args) != len(wants.inputs):
        return False
    for a, want in zip(args, wants.inputs):
        p = placement(prop, a)
        if p == want:
            continue
        if p == REPLICATE and type(want) in (Shard, CopiedHeads):
            if prop.edges.get(node.name, {}).get(a.name) == REPLICATE or not _static(a, want.dim):
                return False  # gathered already (DTensor wants Shard(d) -> Shard(e)), or a
            changes[a] = _as_piece(node, prop, a, want)  # cut along a dynamic dim (the sequence)
        elif type(p) is Shard and gatherable(a, prop):
            changes[a] = REPLICATE  # Shard(d) -> Shard(e) too: gathered, cut next run
        else:
            return False
    if changes:
        return _edges(node, prop, changes)
    if wants.partial in _REDUCIBLE and node.name not in prop.reduces:
        prop.reduce_requests[node.name] = wants.partial
        return True
    return False


def _as_piece(node: fx.Node, prop, a: fx.Node, want):
    """``want`` for the replicated ``a``, or, where ``a`` meets (broadcast, aligned from the
    right) the raw output features of one column linear along the cut dim (a bias computed
    in forward added after a fused q|k|v's product), the cut under that linear's layout
    (:class:`LaidOut`): the op's output stays that linear's raw features, so the layout of
    its parts is found where they are split. Features this run already used as the even
    split (an RMS norm's mean over them, OLMo-2's k_norm) are cut as the even split: their
    layout can be no other."""
    if type(want) is not Shard:
        return want
    right = len(shape(a)) - want.dim
    for b in inputs_of(node):
        keys = prop.raw.get(b.name, ())
        d = dim_of(prop, b)
        if b is not a and len(keys) == 1 and d is not None and len(shape(b)) - d == right:
            key = next(iter(keys))
            return want if None in prop.uses.get(key, {}) else LaidOut(want.dim, key)
    return want


def _edges(node, prop, changes: dict) -> bool:
    """Request the new edges of ``changes``; an edge once asked for is never changed (so the
    runs cannot flip it back and forth)."""
    if any(writes_into(node, a) for a in changes):
        return False  # the op would write into the copy, not the value (DTensor refuses too)
    if returns_view(node) and written_through(node):
        return False  # so would a write through this view of the copy (q[:, 1:3] = ...)
    have = prop.edges.get(node.name, {})
    new = {a.name: w for a, w in changes.items() if a.name not in have}
    for name, w in new.items():
        prop.edge_requests[(node.name, name)] = w
    return bool(new)


def why_not(node: fx.Node, prop) -> str:
    """Why no redistribution can stand in at ``node`` ("" when one might)."""
    sharded = [a for a in inputs_of(node) if placement(prop, a) != REPLICATE]
    if any(writes_into(node, a) for a in sharded):
        return "; it writes into its sharded input in place, which no gathered copy can stand in for"
    if sharded and returns_view(node) and written_through(node):
        # q[:, 1:3] = ...: a view of a gathered copy would take the write, not the tensor
        return ("; a write in place through this view of a sharded value would land in a "
                "gathered copy, not in the value")
    return ""


def written_through(view: fx.Node, nodes=None, depth: int = 8) -> bool:
    """An in-place op (one of ``nodes``, when given) writes into ``view``, or into a view of
    it."""
    return depth > 0 and any(
        (nodes is None or u in nodes) and writes_into(u, view)
        or returns_view(u) and u.args and u.args[0] is view
        and written_through(u, nodes, depth - 1) for u in view.users)


def writes_into(node: fx.Node, a: fx.Node) -> bool:
    """``node`` (an in-place op: ``copy_``, ``add_``) writes into its argument ``a``."""
    return any(v is a for _i, v in written_inputs(node))


def reduced(node: fx.Node, prop, out):
    """``out`` (a rule's answer for ``node``) once the all-reduce a previous run asked for
    follows it: DTensor's Partial(sum | avg) becomes Replicate."""
    if isinstance(out, Wants) and not out.inputs and out.partial == prop.reduces.get(node.name):
        prop.applied_reduces[node.name] = out.partial
        return out.out
    return out
