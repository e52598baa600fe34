"""Sharding rules for cuts of a column output's features into the parts of a ``fused``
layout (:mod:`parallelizer.plan.layouts`): slices of the features (Phi-3's ``qkv[..., a:b]``),
and cuts along the heads of a view into heads (Falcon's ``view(B, T, H + 2, D)`` whose q
heads, k head and v head are sliced, indexed or split out). Each cut is recorded per weight;
:func:`fuse_slices` turns the cuts of one weight into its parts, laying out a part of fewer
heads than tp as copies (``replicated_heads``). See
:mod:`parallelizer.analysis.sharding.propagate` for the whole picture."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...plan.layouts import Fused, ReplicatedHeads, local_length
from ..graph_facts import aten, expr, module_path, shape
from ..linears import full_slice, slice_bound
from .dtensor import dtensor_rule
from .one_head import copied_parts
from .placements import CONFLICT, REPLICATE, PerOutput, Shard, shard
from .state import (HeadsMark, add_constraint, add_rewrite, dim_arg, dim_of, local_at,
                    placement, record_use, sizes_arg)

_SPLIT_CUTS = (aten.split.Tensor, aten.split_with_sizes.default)


def only_cut_on(node, e) -> bool:
    """Every user of ``node`` cuts dim ``e`` (a slice, a split along ``e``, or an index with one
    tensor at ``e``):
    Falcon's ``view(B, T, H + 2, D)`` whose q heads, k head and v head are cut out."""
    def cuts(u):
        if u.op != "call_function" or u.args[0] is not node:
            return False
        if u.target is aten.slice.Tensor and full_slice(u):  # x[:, :, ...]: no-op slices
            return only_cut_on(u, e)
        if u.target is aten.slice.Tensor:
            return dim_arg(u, 1) == e
        if u.target in _SPLIT_CUTS:
            return dim_arg(u, 2) == e
        if u.target is aten.index.Tensor:
            idx = list(u.args[1])
            return [i for i, x in enumerate(idx) if x is not None] == [e]
        return False
    return bool(node.users) and all(cuts(u) for u in node.users)


def fused_heads_view(node, prop, tp, e, raw, heads, head_dim):
    """A column output viewed as (heads, head_dim) and then only cut along the heads: the
    cuts are the parts of a ``fused`` layout counted in heads (:func:`cut_heads`), so the
    view's heads constant is the local length of the fused layout assumed."""
    prop.claimed.add(node.name)
    prop.head_raw[node.name] = (raw, head_dim)
    prop.heads[node.name] = HeadsMark(raw, heads, False)
    local = _local_heads(prop, raw, heads, head_dim, tp)
    sizes = sizes_arg(node)
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, local)
    return Shard(e)


def _common_layout(prop, weights):
    layouts = [prop.layouts.get(w) for w in weights]
    return layouts[0] if layouts and all(x == layouts[0] for x in layouts) else None


def _local_heads(prop, weights, heads, head_dim, tp) -> int:
    layout = _common_layout(prop, weights)
    if isinstance(layout, Fused):
        try:
            return local_length(heads * head_dim, layout, tp) // head_dim
        except ValueError:
            pass  # a layout of another size: the constraints report it
    return max(heads // tp, 1)


def cut_heads(value, src, prop, tp, d, lo, hi):
    """Heads ``[lo, hi)`` of the :func:`fused_heads_view` value ``src``, taken as ``value``
    (a slice, an index or a split's getitem; None for a split output nobody reads): recorded
    as a cut of the weight's features (``head_dim`` units) and marked as heads of their own,
    copied heads (``replicated``) when the fused layout assumed lays that part out
    ``replicated_heads``. Returns (placement, local lo, local hi) in heads, or
    (CONFLICT, None, None)."""
    weights, unit = prop.head_raw[src.name]
    n = int(expr(shape(src)[d]))
    if not 0 <= lo < hi <= n or any(prop.features.get(w) != n * unit for w in weights):
        return CONFLICT, None, None
    name = value.name if value is not None else src.name
    for w in weights:
        prop.slices.setdefault(w, []).append((lo * unit, hi * unit, name, module_path(src)))
        prop.slice_units[w] = unit
    layout = _common_layout(prop, weights)
    if value is not None:
        prop.claimed.add(value.name)
        copied = isinstance(_part_layout(layout, lo * unit, hi * unit), ReplicatedHeads)
        prop.heads[value.name] = HeadsMark(frozenset(weights), hi - lo, copied)
    return (Shard(d), local_at(lo * unit, layout, tp) // unit,
            local_at(hi * unit, layout, tp) // unit)


def _part_layout(layout, lo, hi):
    """The part layout of the fused part that is exactly ``[lo, hi)`` (None otherwise)."""
    if not isinstance(layout, Fused):
        return None
    start = 0
    for part, pl in layout.pairs():
        if (start, start + part) == (lo, hi):
            return pl
        start += part
    return None


def slice_rule(node, prop, tp):
    d = dim_of(prop, node.args[0])
    dim = dim_arg(node, 1)
    if full_slice(node):
        if node.args[0].name in prop.head_raw:  # x[:, :, cut]: the heads view's cuts follow
            prop.head_raw[node.name] = prop.head_raw[node.args[0].name]
        return shard(d)
    if dim != d:
        return shard(d)
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    return _slice_part(node, prop, tp, d, start, end)


def _slice_part(node, prop, tp, d, start, end):
    """Phi-3's ``qkv[..., a:b]``: slices of a column output's features cut it into parts.
    The cuts of all slices of one weight's output give its ``fused`` parts (each slice must
    be exactly one part, checked in :func:`fuse_slices`); the bounds become local offsets."""
    src = node.args[0]
    raw = prop.raw.get(src.name)
    n = shape(src)[d]
    step = node.args[4] if len(node.args) > 4 else 1
    if not (raw or src.name in prop.head_raw) or step != 1 or not isinstance(n, int) \
            or not isinstance(start or 0, int) \
            or not isinstance(end if end is not None else n, int):
        return CONFLICT
    lo, hi = slice_bound(start or 0, n), slice_bound(n if end is None else end, n)
    if src.name in prop.head_raw:
        out, local_lo, local_hi = cut_heads(node, node.args[0], prop, tp, d, lo, hi)
        if out != CONFLICT:
            if lo:
                add_rewrite(prop, node, 2, None, local_lo)
            if hi < n and end is not None:
                add_rewrite(prop, node, 3, None, local_hi)
        return out
    if hi <= lo or any(prop.features.get(w) != n for w in raw):
        return CONFLICT
    prop.claimed.add(node.name)
    for w in raw:
        prop.slices.setdefault(w, []).append((lo, hi, node.name, module_path(node)))
    prop.part_slices[node.name] = (frozenset(raw), lo, hi)
    layout = _common_layout(prop, raw)
    if lo:
        add_rewrite(prop, node, 2, None, local_at(lo, layout, tp))
    if hi < n and end is not None:
        add_rewrite(prop, node, 3, None, local_at(hi, layout, tp))
    return Shard(d)


def sliced_heads(node, prop, d: int, e: int):
    """A view of a :func:`_slice_part` part into (heads, head_dim) (Phi-3's
    ``qkv[..., a:b].view(B, T, -1, D)``): its head_dim becomes the weight's cut unit, so
    :func:`fuse_slices` counts the parts in heads and lays a part of fewer kv heads than tp
    out as copies. Where the layout assumed already does, the view's heads are each rank's
    copy (placed on ``e``, marked replicated, the heads constant made 1); else None (the
    even split of the heads, as any view)."""
    weights, lo, hi = prop.part_slices[node.args[0].name]
    ins, outs = shape(node.args[0]), shape(node)
    if e + 1 >= len(outs) or not all(isinstance(x, int) for x in (ins[d], outs[e + 1])) \
            or ins[d] % outs[e + 1] or ins[d] != hi - lo:
        return None
    unit = outs[e + 1]
    for w in weights:
        prop.slice_units.setdefault(w, unit)
    pl = _part_layout(_common_layout(prop, weights), lo, hi)
    if not isinstance(pl, ReplicatedHeads) or pl.head_dim != unit:
        return None
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(weights, pl.heads, True)
    sizes = sizes_arg(node)
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, 1)
    return Shard(e)


def fuse_slices(prop, tp: int) -> None:
    """Turn the cuts recorded by :func:`_slice_part` and :func:`cut_heads` into one fused
    layout per weight. A part cut in heads (``head_dim`` units) with fewer heads than tp, tp a
    multiple of them, is laid out ``replicated_heads`` (Falcon's one k and one v head: every
    rank holds a copy), valid while its value reaches attention only as kv heads (else the
    planner retries without copies); other parts split evenly, tp dividing their heads."""
    for w, cuts in prop.slices.items():
        n = prop.features[w]
        bounds = sorted({0, n} | {b for lo, hi, _n, _m in cuts for b in (lo, hi)})
        parts = [b - a for a, b in zip(bounds, bounds[1:])]
        for lo, hi, name, _m in cuts:
            if bounds.index(hi) - bounds.index(lo) != 1:  # a slice spanning two parts
                record_use(prop, {w}, None, name)
        unit = prop.slice_units.get(w)
        part_layouts = tuple(_part_in_heads(prop, w, p, unit, parts, cuts[0][3], tp) for p in parts)
        layout = Fused(tuple(parts), part_layouts if any(part_layouts) else None)
        record_use(prop, {w}, layout, cuts[0][2])


def _part_in_heads(prop, w, p, unit, parts, module, tp):
    """Constraints of one fused part, and its layout (None: the even split)."""
    detail = f"a part of the fused output of {w} (sliced into {parts})"
    if not unit or p % unit:
        add_constraint(prop, p, "features", module, detail, origin={w})
        return None
    heads = p // unit
    # only kv parts are copies: a part of fewer heads than the largest (the query heads);
    # parts of equal heads (GPT-2's q|k|v) split evenly, tp dividing their heads
    fewer = heads < max(q // unit for q in parts)
    if fewer and heads % tp and tp % heads == 0 and w not in prop.no_replication:
        add_constraint(prop, heads, "heads", module, f"the heads of {detail}", {w}, {w})
        return ReplicatedHeads(heads, unit)
    add_constraint(prop, heads, "heads", module, f"the heads of {detail}", origin={w})
    return None


def index_rule(node, prop, tp):
    """``x[..., idx]`` with a constant index tensor on the heads dim of a
    :func:`fused_heads_view` value (Falcon's ``qkv[..., [-2], :]``, its k head): a cut of
    consecutive heads. The constant is not rewritten, so its values must already pick the
    rank's own heads of its piece (negative indices counted from the end do, when the parts
    after the cut are laid out alike on every rank). One replicated index tensor on another
    dim (a gather of rows ``m[src]`` of feature-sharded messages, whose size is known only
    at run time, which DTensor's strategy cannot take) keeps the shard, moved by the index's
    rank. Any other index: DTensor's strategy."""
    src, indices = node.args[0], list(node.args[1])
    d = dim_of(prop, src)
    hits = [i for i, x in enumerate(indices) if x is not None]
    if d is not None and len(hits) == 1 and hits[0] != d and isinstance(indices[hits[0]], fx.Node) \
            and placement(prop, indices[hits[0]]) == REPLICATE:
        k = hits[0]
        return Shard(d if d < k else d - 1 + len(shape(indices[k])))
    if src.name not in prop.head_raw or hits != [d]:
        return dtensor_rule(node, prop, tp)
    values = _constant_ints(indices[d])
    n = int(expr(shape(src)[d]))
    if not values or any(not -n <= v < n for v in values):
        return CONFLICT
    full = [v % n for v in values]
    if full != list(range(full[0], full[0] + len(full))):
        return CONFLICT
    out, lo, hi = cut_heads(node, src, prop, tp, d, full[0], full[-1] + 1)
    if out == CONFLICT:
        return CONFLICT
    weights, unit = prop.head_raw[src.name]
    local_n = _local_heads(prop, weights, n, unit, tp)
    if [v % local_n for v in values] != list(range(lo, hi)):
        return CONFLICT
    return Shard(d)


def _constant_ints(node):
    """The values of a 1-D integer tensor constant (a lifted ``get_attr``, possibly through
    ``lift_fresh_copy``), read from the graph's module; None otherwise."""
    while node.op == "call_function" and node.target in (
            aten.lift_fresh_copy.default, aten.clone.default, aten.detach.default,
            aten._to_copy.default, aten.alias.default):
        node = node.args[0]
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    obj = node.graph.owning_module
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    from torch._subclasses.fake_tensor import FakeTensor
    if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.dim() != 1 \
            or obj.dtype not in (torch.int64, torch.int32) or obj.device.type == "meta":
        return None
    return [int(v) for v in obj.tolist()]


def split_heads_cut(node, prop, tp, d):
    """``split`` / ``split_with_sizes`` along the heads of a :func:`fused_heads_view` value
    (Falcon in transformers 5.25: ``qkv.split([H, 1, 1], dim=-2)``): each output is the cut of
    its consecutive heads, the split sizes become the local cuts' sizes. An int split size
    that the local cuts do not share is a conflict (it cannot spell unequal pieces)."""
    sizes = [int(v.shape[d]) for v in node.meta["val"]]
    taken = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    outs, local, lo = [], [], 0
    for i, s in enumerate(sizes):
        out, llo, lhi = cut_heads(taken.get(i), node.args[0], prop, tp, d, lo, lo + s)
        if out == CONFLICT:
            return CONFLICT
        outs.append(out)
        local.append(lhi - llo)
        lo += s
    prop.claimed.add(node.name)
    size = node.args[1]
    if node.target is aten.split.Tensor:
        if len(set(local[:-1])) > 1 or local[-1] > local[0]:
            return CONFLICT
        add_rewrite(prop, node, 1, None, local[0])
    else:
        for i, p in enumerate(local):
            if isinstance(size[i], int):
                add_rewrite(prop, node, 1, i, p)
    return PerOutput(tuple(outs))


def split_parts(node, prop, tp: int, d: int, raw, parts: list):
    """The layout of each part of a split of a column output's features along ``d``, with
    its constraints: a part that is one kv head GPTBigCode keeps (:func:`copied_parts`) is
    ``replicated_heads(1, part)``; with the head_dim the views of the parts gave
    (:func:`sliced_heads`), a part of fewer heads than tp is copies (``torch.split(qkv, [q,
    k, v])`` at tp above the kv heads, :func:`_part_in_heads`); else the even split. Each
    taken part that is not copied already is registered for :func:`sliced_heads`. Returns
    (part layouts, {copied part: its size-1 heads dim})."""
    copied = copied_parts(node, prop, d, raw)
    (w,) = raw if len(raw) == 1 else (None,)
    units = {_view_unit(u, d) for u in node.users if u.target is operator.getitem
             and u.args[1] not in copied} - {None}
    unit = units.pop() if len(units) == 1 and w and \
        node.target is aten.split_with_sizes.default else None
    detail = f"a part of the fused output of {', '.join(sorted(raw))} (split {parts})"
    layouts = []
    for i, p in enumerate(parts):
        if i in copied:
            layouts.append(ReplicatedHeads(1, p))
        elif unit:
            layouts.append(_part_in_heads(prop, w, p, unit, parts, module_path(node), tp))
        else:
            add_constraint(prop, p, "features", module_path(node), detail, origin=raw)
            layouts.append(None)
    starts = [sum(parts[:i]) for i in range(len(parts))]
    for u in node.users:
        if u.target is not operator.getitem:
            continue
        i = u.args[1]
        if i in copied:  # one kv head, copied to every rank
            prop.claimed.add(u.name)
            if copied[i] is not None:
                prop.heads[u.name] = HeadsMark(frozenset(raw), 1, True)
            else:  # no heads dim: held whole (CopiedWhole), until copied_whole_unsqueeze
                prop.copied_whole[u.name] = frozenset(raw)
        else:
            prop.part_slices[u.name] = (frozenset(raw), starts[i], starts[i] + parts[i])
    return tuple(layouts), copied


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _view_unit(value, d: int):
    """The head_dim of a view of ``value`` that splits its dim ``d`` into (heads,
    head_dim) (``k.view(B, T, -1, D)``), else None."""
    ins = shape(value)
    for u in value.users:
        outs = shape(u) if u.target in _VIEWS else ()
        if len(outs) == len(ins) + 1 and all(isinstance(x, int) for x in (
                ins[d], outs[d], outs[d + 1])) and outs[d] * outs[d + 1] == ins[d] > outs[d + 1]:
            return outs[d + 1]
    return None
