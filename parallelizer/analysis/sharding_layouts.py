"""Sharding rules that decide tp layouts (:mod:`parallelizer.layouts`): views into heads
(Megatron's heads split, GQA kv heads copied when tp exceeds them), repeat_kv's expand,
and splits / slices of a column output's features (fused q|k|v, gate|up; GPT-NeoX's
per-head interleaving). See :mod:`parallelizer.analysis.sharding` for the whole picture."""
from __future__ import annotations

import json

from ..layouts import local_length
from .graph_facts import aten, expr, module_path, prod, same, shape
from .sharding_state import (INVALID, HeadsMark, add_constraint, add_rewrite, dim_arg, placement,
                             record_use, sizes_arg)


def view_rule(node, prop, tp):
    """view/reshape: find the output dim that starts where the sharded input dim starts.
    Same size: the shard stays; a split (hidden -> heads, head_dim): the shard goes to the
    outer (heads) dim; a merge (heads, head_dim -> hidden): the shard goes to the merged dim.
    An int size constant on that dim is divided by tp (or set to the layout's local length)."""
    src = node.args[0]
    d = placement(prop, src)
    ins, outs = shape(src), shape(node)
    mark = prop.heads.get(src.name)
    if mark is not None and mark.replicated:
        return _merge_repeated_heads(node, prop, tp, d, mark)
    before = prod(ins[:d])
    e = next((e for e in range(len(outs)) if same(prod(outs[:e]), before)), None)
    raw = prop.raw.get(src.name)
    if e is not None and raw and _one_head(ins[d], outs, e) and not (raw & prop.no_replication):
        # (.., kv * head_dim) -> (.., 1, head_dim): one kv head (multi-query), copied to
        # every rank; the planner retries without copies if it reaches anything but repeat_kv
        return _split_heads(node, prop, tp, e, raw, f"dim {e} of the view (one head)")
    while e is not None and e < len(outs) - 1 and same(outs[e], 1) and not same(ins[d], 1):
        e += 1
    if e is None:
        return INVALID
    ratio_split = expr(ins[d]) / expr(outs[e])
    if not (same(ins[d], outs[e]) or ratio_split.is_integer or (1 / ratio_split).is_integer):
        return INVALID
    sizes = sizes_arg(node)
    detail = (f"dim {e} of the {node.target.__name__.split('.')[0]} to "
              f"[{', '.join(str(o) if isinstance(o, int) else '*' for o in outs)}]")
    if same(ins[d], outs[e]):
        add_constraint(prop, int(expr(outs[e])), "features", module_path(node), detail)
        local = _local_features(prop, raw, int(expr(outs[e])), tp)
    elif raw and ratio_split.is_integer:
        return _split_heads(node, prop, tp, e, raw, detail)
    else:
        add_constraint(prop, int(expr(outs[e])), "heads", module_path(node), detail)
        local = int(expr(outs[e])) // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, local)
    return e


def _one_head(features, outs, e) -> bool:
    return e + 1 < len(outs) and same(outs[e], 1) and same(outs[e + 1], features) \
        and not same(features, 1)


def _local_features(prop, raw, n, tp) -> int:
    layouts = {json.dumps(prop.layouts.get(w), sort_keys=True) for w in raw or ()}
    if len(layouts) == 1:
        layout = json.loads(layouts.pop())
        try:
            return local_length(n, layout, tp)
        except ValueError:
            pass  # a layout of another size: the constraints report it
    return n // tp


def _split_heads(node, prop, tp, e, raw, detail):
    """A column output's features split into (heads, head_dim): Megatron's heads split,
    or, for fewer heads than tp (GQA kv heads), one head copied to ``tp / heads`` ranks."""
    heads = int(expr(shape(node)[e]))
    head_dim = int(expr(shape(node.args[0])[placement(prop, node.args[0])])) // heads
    replicate = heads % tp != 0 and tp % heads == 0 and not (raw & prop.no_replication)
    add_constraint(prop, heads, "heads", module_path(node), detail, raw)
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(raw, heads, replicate)
    for w in raw:
        prop.head_shapes[w] = (heads, head_dim)
    sizes = sizes_arg(node)
    if replicate:
        record_use(prop, raw, {"kind": "replicated_heads", "heads": heads, "head_dim": head_dim}, node)
        local = 1
    else:
        record_use(prop, raw, None, node)
        local = heads // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, local)
    return e


def _merge_repeated_heads(node, prop, tp, d, mark):
    """repeat_kv's reshape (B, kv, n_rep, T, D) -> (B, heads, T, D) of replicated kv heads:
    each rank's (1, heads / tp) piece is its even block of the query heads."""
    ins, outs = shape(node.args[0]), shape(node)
    merged = d + 1 < len(ins) and d < len(outs) and same(prod(outs[:d]), prod(ins[:d])) and \
        same(outs[d], expr(ins[d]) * expr(ins[d + 1]))
    if not (mark.expanded and merged):
        return INVALID
    prop.claimed.add(node.name)
    heads = int(expr(outs[d]))
    add_constraint(prop, heads, "heads", module_path(node), f"dim {d} of the repeat_kv reshape")
    sizes = sizes_arg(node)
    if isinstance(sizes[d], int) and sizes[d] != -1:
        add_rewrite(prop, node, 1, d, heads // tp)
    return d


def expand_rule(node, prop, tp):
    src = node.args[0]
    d = placement(prop, src)
    e = d + len(shape(node)) - len(shape(src))
    sizes = sizes_arg(node)
    mark = prop.heads.get(src.name)
    if mark is not None and _is_repeat_kv(node, d, e):
        prop.kv_weights |= mark.weights
        if mark.replicated:
            return _repeat_replicated_kv(node, prop, tp, e, mark)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        add_constraint(prop, sizes[e], "heads", module_path(node), f"dim {e} of expand",
                    mark.weights if mark is not None else ())
        add_rewrite(prop, node, 1, e, sizes[e] // tp)
    return e


def _is_repeat_kv(node, d, e) -> bool:
    """expand (B, kv, 1, T, D) -> (B, kv, n_rep, T, D): transformers' repeat_kv."""
    ins, outs = shape(node.args[0]), shape(node)
    return d + 1 < len(ins) and e + 1 < len(outs) and same(ins[d + 1], 1) \
        and isinstance(outs[e + 1], int) and outs[e + 1] > 1


def _repeat_replicated_kv(node, prop, tp, e, mark):
    """Rank r holds kv head ``r // (tp / kv)`` and serves ``heads / tp`` query heads, so its
    local expand is (B, 1, n_rep * kv / tp, T, D)."""
    n_rep = int(shape(node)[e + 1])
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(mark.weights, mark.heads, True, expanded=True)
    add_constraint(prop, n_rep * mark.heads, "heads", module_path(node),
                f"dims {e}, {e + 1} of expand")
    sizes = sizes_arg(node)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, 1)
    if isinstance(sizes[e + 1], int) and sizes[e + 1] != -1:
        add_rewrite(prop, node, 1, e + 1, n_rep * mark.heads // tp)
    return e


def slice_rule(node, prop, tp):
    d = placement(prop, node.args[0])
    dim = dim_arg(node, 1)
    if dim != d:
        return d
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    full = start in (0, None) and (end is None or (isinstance(end, int) and end >= 2 ** 62))
    if full:
        return d
    return _slice_part(node, prop, tp, d, start, end)


def _slice_part(node, prop, tp, d, start, end):
    """Phi-3's ``qkv[..., a:b]``: slices of a column output's features cut it into parts.
    The cuts of all slices of one weight's output give its ``fused`` parts (each slice must
    be exactly one part, checked in :func:`fuse_slices`); the bounds become local offsets."""
    src = node.args[0]
    raw = prop.raw.get(src.name)
    n = shape(src)[d]
    step = node.args[4] if len(node.args) > 4 else 1
    if not raw or step != 1 or not isinstance(n, int) or not isinstance(start or 0, int) \
            or not isinstance(end if end is not None else n, int):
        return INVALID
    lo, hi = max(0, min(start or 0, n)), max(0, min(n if end is None else end, n))
    if hi <= lo or any(prop.features.get(w) != n for w in raw):
        return INVALID
    prop.claimed.add(node.name)
    for w in raw:
        prop.slices.setdefault(w, []).append((lo, hi, node.name, module_path(node)))
    layouts = [prop.layouts.get(w) for w in raw]
    layout = layouts[0] if all(x == layouts[0] for x in layouts) else None
    if lo:
        add_rewrite(prop, node, 2, None, _local_offset(lo, layout, tp))
    if hi < n and end is not None:
        add_rewrite(prop, node, 3, None, _local_offset(hi, layout, tp))
    return d


def _local_offset(at: int, layout, tp: int) -> int:
    """Where full offset ``at`` (a part boundary) lands in a rank's fused piece."""
    if not layout or layout.get("kind") != "fused":
        return at // tp
    full = local = 0
    for part in layout["parts"]:
        if full >= at:
            break
        full, local = full + part, local + part // tp
    return local


def fuse_slices(prop) -> None:
    """Turn the cuts recorded by :func:`_slice_part` into one fused layout per weight."""
    for w, cuts in prop.slices.items():
        n = prop.features[w]
        bounds = sorted({0, n} | {b for lo, hi, _n, _m in cuts for b in (lo, hi)})
        parts = [b - a for a, b in zip(bounds, bounds[1:])]
        for lo, hi, name, _m in cuts:
            if bounds.index(hi) - bounds.index(lo) != 1:  # a slice spanning two parts
                record_use(prop, {w}, None, name)
        for p in parts:
            add_constraint(prop, p, "features", cuts[0][3], f"a part of the fused output of {w} "
                        f"(sliced into {parts})")
        record_use(prop, {w}, {"kind": "fused", "parts": parts}, cuts[0][2])


def split_rule(node, prop, tp):
    d = placement(prop, node.args[0])
    dim = dim_arg(node, 2) if node.target is not aten.unbind.int else dim_arg(node, 1)
    n = len(node.meta["val"])
    if dim == d:
        return _split_fused(node, prop, tp, d, n)
    mark = prop.heads.get(node.args[0].name)
    if mark is not None and not mark.replicated and not mark.expanded and n > 1 \
            and dim == len(shape(node.args[0])) - 1 and node.target is not aten.unbind.int:
        # GPT-NeoX: (B, T, heads, 3 * head_dim) per-head [q k v], split after the heads
        record_use(prop, mark.weights, {"kind": "interleaved_heads", "heads": mark.heads}, node)
    if node.target is aten.unbind.int:
        return tuple((d - (1 if dim < d else 0)) for _ in range(n))
    return tuple(d for _ in range(n))


def _split_fused(node, prop, tp, d, n):
    """Split of a column output's features into parts (GPT-2's q|k|v, a fused gate|up):
    the weight becomes ``fused`` with these parts, so each rank splits its own piece into
    its block of every part; the split sizes become local."""
    src = node.args[0]
    raw = prop.raw.get(src.name)
    full = shape(src)[d]
    if not raw or node.target is aten.unbind.int or not isinstance(full, int):
        return INVALID
    parts = [int(v.shape[d]) for v in node.meta["val"]]
    if sum(parts) != full or any(prop.features.get(w) != full for w in raw):
        return INVALID
    for p in parts:
        add_constraint(prop, p, "features", module_path(node),
                    f"a part of the fused output of {', '.join(sorted(raw))} (split {parts})")
    prop.claimed.add(node.name)
    record_use(prop, raw, {"kind": "fused", "parts": parts}, node)
    size = node.args[1]
    if node.target is aten.split.Tensor and isinstance(size, int):
        add_rewrite(prop, node, 1, None, size // tp)
    elif node.target is aten.split_with_sizes.default:
        for i, p in enumerate(size):
            if isinstance(p, int):
                add_rewrite(prop, node, 1, i, p // tp)
    return tuple(d for _ in range(n))
