"""Sharding rules that decide tp layouts (:mod:`parallelizer.plan.layouts`): views into heads
(Megatron's heads split, GQA kv heads copied when tp exceeds them), repeat_kv's expand,
views into packed parts (torch's in_proj, timm's qkv) and splits of a column output's features
(fused q|k|v, gate|up; GPT-NeoX's per-head interleaving). Slices and cuts along a heads view
are in :mod:`.cuts`. See :mod:`parallelizer.analysis.sharding.propagate` for the whole picture."""
from __future__ import annotations

import torch.fx as fx

from ...plan.layouts import Fused, InterleavedHeads, ReplicatedHeads, local_length, part_length
from ..graph_facts import aten, expr, module_path, prod, same, shape
from ..linears import VIEWS
from .cuts import fused_heads_view, only_cut_on, sliced_heads, split_heads_cut, split_parts
from .placements import CONFLICT, COPIED_WHOLE, PerOutput, Shard, shard
from .strided import local_merged_size, merge_view, strided_view
from .state import (HeadsMark, add_constraint, add_rewrite, copies_refused, copyable, dim_arg,
                    dim_of, record_use, sizes_arg)


def view_rule(node, prop, tp):
    """view/reshape: find the output dim that starts where the sharded input dim starts.
    Same size: the shard stays; a split (hidden -> heads, head_dim): the shard goes to the
    outer (heads) dim; a merge (heads, head_dim -> hidden): the shard goes to the merged dim.
    An int size constant on that dim is divided by tp (or set to the layout's local length)."""
    src = node.args[0]
    d = dim_of(prop, src)
    ins, outs = shape(src), shape(node)
    mark = prop.heads.get(src.name)
    if mark is not None and mark.replicated:
        if not mark.expanded and _keeps_dim(ins, outs, d):
            return _keep_copied_heads(node, prop, d, mark)
        return merge_repeated_heads(node, prop, tp, d, mark)
    if src.name in prop.strided:
        return strided_view(node, prop, tp, d)
    before = prod(ins[:d])
    e = next((e for e in range(len(outs)) if same(prod(outs[:e]), before)), None)
    raw = prop.raw.get(src.name)
    if e is not None and src.name in prop.part_slices:  # copied kv heads of a sliced part
        out = sliced_heads(node, prop, d, e)
        if out is not None:
            return out
    if e is not None and raw and _one_head(ins[d], outs, e) and not (raw & prop.no_replication):
        # (.., kv * head_dim) -> (.., 1, head_dim): one kv head (multi-query), copied to
        # every rank; the planner retries without copies if it reaches anything but repeat_kv
        return _split_heads(node, prop, tp, e, raw, f"dim {e} of the view (one head)")
    if e is not None and _one_head(ins[d], outs, e):
        prop.one_head_dim |= prop.groups.get(src.name, frozenset())
    while e is not None and e < len(outs) - 1 and same(outs[e], 1) and not same(ins[d], 1):
        e += 1
    if e is None:  # merged with the dims before it: (batch, heads) -> batch * heads
        return merge_view(node, prop, tp, d)
    ratio_split = expr(ins[d]) / expr(outs[e])
    if not (same(ins[d], outs[e]) or ratio_split.is_integer or (1 / ratio_split).is_integer):
        return CONFLICT
    sizes = sizes_arg(node)
    detail = (f"dim {e} of the {node.target.__name__.split('.')[0]} to "
              f"[{', '.join(str(o) if isinstance(o, int) else '*' for o in outs)}]")
    if same(ins[d], outs[e]):
        add_constraint(prop, int(expr(outs[e])), "features", module_path(node), detail)
        local = _local_features(prop, raw, int(expr(outs[e])), tp)
    elif raw and ratio_split.is_integer and _packed_parts(ins[d], outs, e, tp) \
            and (_parts_taken(node, e) or _parts_contracted(node, e)):
        return _split_parts(node, prop, tp, e, raw, detail)
    elif raw and ratio_split.is_integer:
        return _split_heads(node, prop, tp, e, raw, detail)
    elif not isinstance(expr(outs[e]), int) and not expr(outs[e]).is_number:
        # the sharded dim merged with a symbolic inner one ((heads, batch) -> heads * batch):
        # the even split of the merged dim, its size constant made local
        add_constraint(prop, int(expr(ins[d])), "heads", module_path(node), detail)
        return Shard(e) if local_merged_size(node, prop, e, int(expr(ins[d])), tp) else CONFLICT
    else:
        add_constraint(prop, int(expr(outs[e])), "heads", module_path(node), detail,
                       origin=prop.groups.get(src.name, frozenset()))
        local = int(expr(outs[e])) // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, local)
    elif e < len(sizes) and isinstance(sizes[e], fx.Node):
        # a size the graph computes at run time (the global one: Hourglass's C after an
        # upsampling reshape is ``128 * (T // 2) // T``): inferred instead, the one -1
        if -1 in sizes or local * tp != int(expr(outs[e])):
            return CONFLICT
        add_rewrite(prop, node, 1, e, -1)
    return Shard(e)


def _part_dims(features, outs, e) -> int:
    """How many dims after ``e`` hold one part when the view cuts the features into
    (P, part) or (P, heads, head_dim); 0 when it does not."""
    def num(x):
        return isinstance(expr(x), int) or expr(x).is_number
    if not num(features) or not num(outs[e]):
        return 0
    total, n = int(expr(features)) // max(int(expr(outs[e])), 1), 1
    for k in range(e + 1, min(e + 3, len(outs))):
        if not num(outs[k]):
            return 0
        n *= int(expr(outs[k]))
        if n == total:
            return k - e
    return 0


def _packed_parts(features, outs, e, tp) -> bool:
    """The view cuts the features into P parts (``(P, part)`` or ``(P, heads, head_dim)``)
    with tp dividing the dim after it: torch's ``nn.MultiheadAttention`` packs q, k and v in
    one in_proj and ``unflatten(-1, (3, E))``s its output (k and v, ``(2, E)``, in
    cross-attention), timm's ViT ``reshape(B, N, 3, H, D)``s its qkv. The caller also asks
    that every use takes the parts one by one (:func:`_parts_taken`): as heads, P = tp
    would hand rank 0 all of k and rank 1 all of v, and each select would gather them."""
    k = _part_dims(features, outs, e)
    if not k:
        return False
    parts, inner = int(expr(outs[e])), int(expr(outs[e + 1]))
    # split as heads, P parts tp neither divides nor copies fail too: the size tp must
    # divide is then a part's (6 heads of q, k and v, not the 3 parts)
    return parts > 1 and (inner % tp == 0 or parts % tp != 0 and tp % parts != 0)


_SAME_DIMS = {aten.contiguous.default, aten.clone.default, aten.alias.default}


def _parts_taken(node, dim: int, depth: int = 8) -> bool:
    """Every use of ``node`` takes the parts along ``dim`` one by one (select or unbind),
    through the moves of :func:`_dim_after`: q, k and v used apart."""
    if depth == 0 or not node.users:
        return False
    rank = len(shape(node))
    for u in node.users:
        if u.op == "call_function" and u.target is aten.cat.default \
                and dim_arg(u, 1, rank) != dim:
            nxt = dim  # packed with other parts along another dim (MMDiT's joint sequence)
        elif u.op == "call_function" and u.target in (aten.select.int, aten.unbind.int) \
                and u.args[0] is node and dim_arg(u, 1) == dim:
            continue
        else:
            nxt = _dim_after(node, u, dim)
        if nxt is None or not _parts_taken(u, nxt, depth - 1):
            return False
    return True


def _parts_contracted(node, dim: int, depth: int = 8) -> bool:
    """Every use of ``node`` brings ``dim`` to the last dim of attention's q, k or v
    (``scaled_dot_product_attention``), through the moves of :func:`_dim_after` and scalings
    by a number: the parts are head_dim, and the dim after them the heads (``view(B, T,
    head_dim, heads)``, heads innermost; zoo 20 Z8, whose q, k and v were gathered)."""
    if depth == 0 or not node.users:
        return False
    for u in node.users:
        if u.op == "call_function" and u.target is aten.scaled_dot_product_attention.default \
                and node in u.args[:3] and node not in u.args[3:]:
            if dim != len(shape(node)) - 1:
                return False
            continue
        if u.op == "call_function" and u.target in (aten.mul.Tensor, aten.div.Tensor) \
                and u.args[0] is node and isinstance(u.args[1], (int, float)):
            nxt = dim
        else:
            nxt = _dim_after(node, u, dim)
        if nxt is None or not _parts_contracted(u, nxt, depth - 1):
            return False
    return True


def _dim_after(node, u, dim: int):
    """Where dim ``dim`` of ``node`` is in the output of its user ``u``, for ops that move
    dims without mixing them (copies, unsqueeze, squeeze of another dim, transpose,
    permute, a view keeping the dim); None for any other op."""
    if u.op != "call_function" or u.args[0] is not node:
        return None
    t, rank = u.target, len(shape(node))
    if t in _SAME_DIMS:
        return dim
    if t is aten.unsqueeze.default:
        return dim + (1 if u.args[1] % (rank + 1) <= dim else 0)
    if t is aten.squeeze.dim and u.args[1] % rank != dim:
        return dim - (1 if u.args[1] % rank < dim else 0)
    if t is aten.transpose.int:
        a, b = u.args[1] % rank, u.args[2] % rank
        return b if dim == a else a if dim == b else dim
    if t is aten.permute.default:
        return [p % rank for p in u.args[1]].index(dim)
    if t in VIEWS:
        # SAM's ``reshape(3, B * heads, N, hd)`` of (3, B, heads, N, hd): other dims merge
        return _kept_at(shape(node), shape(u), dim)
    return None


def _kept_at(ins, outs, dim):
    """The output dim of a view that holds input dim ``dim`` as it is (the same size, after
    as many elements), else None."""
    before = prod(ins[:dim])
    return next((e for e in range(len(outs)) if same(prod(outs[:e]), before)
                 and same(outs[e], ins[dim])), None)


def _split_parts(node, prop, tp, e, raw, detail):
    """A column output's features viewed as P parts: the weight becomes ``fused`` with P
    equal parts, each rank holding its block of every part, so the shard is on the dim after
    the parts (a part's features, or its heads) and that size constant becomes local."""
    outs = shape(node)
    parts, inner = int(expr(outs[e])), int(expr(outs[e + 1]))
    part = int(expr(shape(node.args[0])[dim_of(prop, node.args[0])])) // parts
    kind = "features" if _part_dims(part * parts, outs, e) == 1 else "heads"
    add_constraint(prop, inner, kind, module_path(node), f"a part of {detail}", origin=raw)
    prop.claimed.add(node.name)
    record_use(prop, raw, Fused((part,) * parts), node)
    sizes = sizes_arg(node)
    if e + 1 < len(sizes) and isinstance(sizes[e + 1], int) and sizes[e + 1] != -1:
        add_rewrite(prop, node, 1, e + 1, inner // tp)
    return Shard(e + 1)


def _one_head(features, outs, e) -> bool:
    """A view ``(.., features) -> (.., 1, features)``: one head. Never the outermost dim,
    which batch or tokens precede in any activation: DoRA's per-feature scale
    ``(m / norm).view(1, -1)`` is no head."""
    return 0 < e and e + 1 < len(outs) and same(outs[e], 1) and same(outs[e + 1], features) \
        and not same(features, 1)


def _local_features(prop, raw, n, tp) -> int:
    layouts = {prop.layouts.get(w) for w in raw or ()}
    if len(layouts) == 1:
        layout = layouts.pop()
        try:
            return local_length(n, layout, tp)
        except ValueError:
            pass  # a layout of another size: the constraints report it
    return n // tp


def _split_heads(node, prop, tp, e, raw, detail):
    """A column output's features split into (heads, head_dim): Megatron's heads split,
    or, for fewer heads than tp (GQA kv heads), one head copied to ``tp / heads`` ranks."""
    heads = int(expr(shape(node)[e]))
    features = int(expr(shape(node.args[0])[dim_of(prop, node.args[0])]))
    head_dim = features // heads
    if only_cut_on(node, e):
        return fused_heads_view(node, prop, tp, e, raw, heads, head_dim)
    replicate = heads % tp != 0 and tp % heads == 0 and not (raw & prop.no_replication)
    add_constraint(prop, heads, "heads", module_path(node), detail, copyable(prop, raw),
                   origin=raw, note=copies_refused(prop, raw))
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(raw, heads, replicate)
    for w in raw:
        prop.head_shapes[w] = (heads, head_dim)
    sizes = sizes_arg(node)
    if replicate:
        record_use(prop, raw, ReplicatedHeads(heads, head_dim), node)
        local = 1
    else:
        record_use(prop, raw, None, node)
        local = heads // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, local)
    elif e < len(sizes) and isinstance(sizes[e], fx.Node):
        return CONFLICT  # a heads count computed at run time: no local value to write
    return Shard(e)


def _keeps_dim(ins, outs, d) -> bool:
    return d < len(outs) and same(prod(ins[:d]), prod(outs[:d])) and same(ins[d], outs[d])


def _keep_copied_heads(node, prop, d, mark):
    """A view that leaves the dim of copied kv heads as it is (Falcon's k ``reshape(B, 1, T,
    D)``): each rank still holds its one copied head there."""
    prop.claimed.add(node.name)
    prop.heads[node.name] = mark
    sizes = sizes_arg(node)
    if d < len(sizes) and isinstance(sizes[d], int) and sizes[d] not in (-1, 1):
        add_rewrite(prop, node, 1, d, 1)
    return Shard(d)


def merge_repeated_heads(node, prop, tp, d, mark):
    """repeat_kv's reshape (B, kv, n_rep, T, D) -> (B, heads, T, D) of replicated kv heads,
    or a flatten of those dims: each rank's (1, heads / tp) piece is its even block of the
    query heads."""
    ins, outs = shape(node.args[0]), shape(node)
    merged = d + 1 < len(ins) and d < len(outs) and same(prod(outs[:d]), prod(ins[:d])) and \
        same(outs[d], expr(ins[d]) * expr(ins[d + 1]))
    if not (mark.expanded and merged):
        return CONFLICT
    prop.claimed.add(node.name)
    heads = int(expr(outs[d]))
    add_constraint(prop, heads, "heads", module_path(node), f"dim {d} of the repeat_kv reshape")
    sizes = sizes_arg(node)
    if isinstance(sizes[d], int) and sizes[d] != -1:
        add_rewrite(prop, node, 1, d, heads // tp)
    return Shard(d)


def expand_rule(node, prop, tp):
    src = node.args[0]
    d = dim_of(prop, src)
    e = d + len(shape(node)) - len(shape(src))
    sizes = sizes_arg(node)
    mark = prop.heads.get(src.name)
    if mark is not None and _is_repeat_kv(node, d, e):
        prop.kv_weights |= mark.weights
        if mark.replicated:
            return _repeat_replicated_kv(node, prop, tp, e, mark)
    if mark is not None and mark.replicated and not mark.expanded and d == e \
            and same(shape(src)[d], 1):
        return _expand_one_head(node, prop, tp, e, mark)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        add_constraint(prop, sizes[e], "heads", module_path(node), f"dim {e} of expand",
                       copyable(prop, mark.weights) if mark is not None else (),
                       origin=prop.groups.get(src.name, frozenset()))
        add_rewrite(prop, node, 1, e, sizes[e] // tp)
    return Shard(e)


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
    return Shard(e)


def _expand_one_head(node, prop, tp, e, mark):
    """Multi-query attention spread by a plain expand (B, 1, T, D) -> (B, heads, T, D) of
    the one kv head, copied to every rank: each rank's (B, heads / tp, T, D) piece is its
    even block of the query heads, all copies of that head (a plain Shard from here on, as
    after repeat_kv's reshape)."""
    heads = int(expr(shape(node)[e]))
    prop.claimed.add(node.name)
    prop.kv_weights |= mark.weights
    add_constraint(prop, heads, "heads", module_path(node), f"dim {e} of expand")
    sizes = sizes_arg(node)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, heads // tp)
    return Shard(e)


def split_rule(node, prop, tp):
    d = dim_of(prop, node.args[0])
    dim = dim_arg(node, 2) if node.target is not aten.unbind.int else dim_arg(node, 1)
    n = len(node.meta["val"])
    if dim == d and node.args[0].name in prop.head_raw and node.target is not aten.unbind.int:
        return split_heads_cut(node, prop, tp, d)
    if dim == d:
        return _split_fused(node, prop, tp, d, n)
    mark = prop.heads.get(node.args[0].name)
    if mark is not None and not mark.replicated and not mark.expanded and n > 1 \
            and dim == len(shape(node.args[0])) - 1 and node.target is not aten.unbind.int:
        # GPT-NeoX: (B, T, heads, 3 * head_dim) per-head [q k v], split after the heads
        record_use(prop, mark.weights, InterleavedHeads(mark.heads), node)
    if node.target is aten.unbind.int:
        return PerOutput(tuple(Shard(d - (1 if dim < d else 0)) for _ in range(n)))
    return PerOutput(tuple(shard(d) for _ in range(n)))


def _part_local(p: int, layout, tp: int) -> int:
    try:
        return part_length(p, layout, tp)
    except ValueError:  # a size tp does not divide: its constraint reports it
        return p // tp


def _split_fused(node, prop, tp, d, n):
    """Split of a column output's features into parts (GPT-2's q|k|v, a fused gate|up):
    the weight becomes ``fused`` with these parts, so each rank splits its own piece into
    its block of every part; the split sizes become local."""
    src = node.args[0]
    raw = prop.raw.get(src.name)
    full = shape(src)[d]
    if not raw or node.target is aten.unbind.int or not isinstance(full, int):
        return CONFLICT
    parts = [int(v.shape[d]) for v in node.meta["val"]]
    if sum(parts) != full or any(prop.features.get(w) != full for w in raw):
        return CONFLICT
    part_layouts, copied = split_parts(node, prop, tp, d, raw, parts)
    prop.claimed.add(node.name)
    record_use(prop, raw, Fused(tuple(parts), part_layouts if any(part_layouts) else None), node)
    size = node.args[1]
    if node.target is aten.split.Tensor and isinstance(size, int):
        add_rewrite(prop, node, 1, None, size // tp)
    elif node.target is aten.split_with_sizes.default:
        for i, p in enumerate(size):
            if isinstance(p, int):
                add_rewrite(prop, node, 1, i, _part_local(p, part_layouts[i], tp))
    return PerOutput(tuple(COPIED_WHOLE if i in copied and copied[i] is None else
                           Shard(copied.get(i, d)) for i in range(n)))

