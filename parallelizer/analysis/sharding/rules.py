"""Per-op sharding rules over one tp mesh dim, after DTensor's op strategies
(torch/distributed/tensor/_ops): each maps an op's input placements to its output placement
(:mod:`.placements`), or CONFLICT. The rules that decide layouts live in :mod:`.layouts`."""
from __future__ import annotations

import operator

from ..graph_facts import aten, expr, is_tensor, same, shape
from .dtensor import Wants, tensor_args
from .channels import CONVS, batch_norm_rule, group_norm_rule, grouped_conv_rule
from .heads import embedding_rule, even_split, request_heads
from .cuts import index_rule, slice_rule
from .einsum_read import einsum_letters
from .layouts import expand_rule, split_rule, view_rule
from .placements import CONFLICT, REPLICATE, CopiedHeads, PerOutput, Shard, shard
from .state import dim_arg, dim_of, inputs_of, placement
from .relayout import complex_view_rule, flatten_rule, repeat_interleave_rule
from .strided import repeat_rule


_SAME_AS_INPUT = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.dropout.default,
    aten.type_as.default, aten.lift_fresh_copy.default, aten.to.device,
}
# unflatten is a view whose sizes are those of the dims it splits (state.sizes_arg)
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
            aten._log_softmax.default}
_REDUCE = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unbind.int}


def _same(node, prop, tp):
    return placement(prop, node.args[0])


def pointwise_rule(node, prop, tp):
    """Broadcasting elementwise op: every sharded input maps to one output dim; replicated
    inputs must broadcast (size 1) along it."""
    out_rank = len(shape(node))
    dims = set()
    for a in inputs_of(node):
        p = dim_of(prop, a)
        if p is not None and is_tensor(a):
            dims.add(p + out_rank - len(shape(a)))
    if len(dims) != 1:
        return CONFLICT
    d = dims.pop()
    for a in inputs_of(node):
        if is_tensor(a) and dim_of(prop, a) is None:
            k = d - (out_rank - len(shape(a)))
            if k >= 0 and not same(shape(a)[k], 1):
                return CONFLICT
    return Shard(d)


def _transpose(node, prop, tp):
    d = dim_of(prop, node.args[0])
    a, b = dim_arg(node, 1), dim_arg(node, 2)
    return shard(b if d == a else a if d == b else d)


def _permute(node, prop, tp):
    d = dim_of(prop, node.args[0])
    order = [p % len(node.args[1]) for p in node.args[1]]
    return Shard(order.index(d))


def _unsqueeze(node, prop, tp):
    d = dim_of(prop, node.args[0])
    u = node.args[1] % len(shape(node))
    return Shard(d + 1 if u <= d else d)


def _squeeze(node, prop, tp):
    d = dim_of(prop, node.args[0])
    ins = shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(ins) if same(s, 1)]
    dims = [x % len(ins) for x in ([dims] if isinstance(dims, int) else dims)]
    dims = [x for x in dims if same(ins[x], 1)]
    if d in dims:
        return CONFLICT
    return Shard(d - sum(1 for x in dims if x < d))


def _select(node, prop, tp):
    d = dim_of(prop, node.args[0])
    dim = dim_arg(node, 1)
    return CONFLICT if dim == d else Shard(d - (1 if dim < d else 0))


def _unfold(node, prop, tp):
    """``t.unfold(dim, size, step)``: windows along ``dim`` as a new last dim, a view that
    keeps every other dim (local-attention's look-around buckets); DTensor 2.13 has no
    strategy for it."""
    d = dim_of(prop, node.args[0])
    return CONFLICT if d == dim_arg(node, 1) else Shard(d)


def _cat(node, prop, tp):
    tensors = node.args[0]
    rank = len(shape(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    ps = {placement(prop, t) for t in tensors}
    if len(ps) != 1 or REPLICATE in ps or Shard(dim) in ps:
        return CONFLICT
    return ps.pop()


def _index_add(node, prop, tp):
    """``self.index_add(dim, index, source)`` and ``index_copy``, in place or not: rows of
    ``source`` added (copied) into ``self`` at ``index`` along ``dim``. ``self`` and
    ``source`` sharded along one other dim and ``index`` replicated: each rank writes its
    block of every row (GIN's neighbour sum ``zeros_like(m).index_add_(0, dst, m[src])``
    over feature-sharded messages). DTensor 2.13 has no strategy for these ops."""
    x, dim, index, src = node.args[:4]
    d = dim % len(shape(node))
    px, ps = dim_of(prop, x), dim_of(prop, src)
    if px is None or px != ps or px == d or placement(prop, index) != REPLICATE:
        return CONFLICT
    return Shard(px)


def _sdpa(node, prop, tp):
    """Attention over a sharded heads dim (Megatron-LM §3: heads split across ranks)."""
    q, k, v = node.args[:3]
    heads = len(shape(q)) - 3
    if {placement(prop, q), placement(prop, k), placement(prop, v)} != {Shard(heads)}:
        return _sdpa_cuts(node, prop, tp, heads)
    copied = [prop.heads[a.name] for a in (k, v) if a.name in prop.heads
              and prop.heads[a.name].replicated]
    if node.kwargs.get("enable_gqa"):
        _gqa_kv(node, prop, k, v)
    elif copied:
        # one copied kv head (Falcon multi-query) broadcast over the rank's query heads
        if any(not same(shape(a)[heads], 1) for a in (k, v)) or q.name in prop.heads \
                and prop.heads[q.name].replicated:
            return CONFLICT
        _gqa_kv(node, prop, k, v)
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if is_tensor(mask):
        m = shape(mask)
        k_ = heads - (len(shape(q)) - len(m))
        pm = dim_of(prop, mask)
        if pm is not None and pm != k_:
            return CONFLICT
        if pm is None and k_ >= 0 and not same(m[k_], 1):
            # a per-head bias (T5): shard its source along heads in the next run
            groups = frozenset().union(*[prop.groups.get(a.name, frozenset()) for a in (q, k, v)])
            request_heads(prop, mask, k_, groups)
            return CONFLICT
    return Shard(heads)


def _sdpa_cuts(node, prop, tp, heads):
    """Some of q, k, v sharded along the heads and the others computed whole (a k whose norm
    spans the whole projection kept its k_proj replicated): DTensor's answer for attention,
    cut the whole ones to the rank's heads, no communication forward (its strategies shard
    q, k and v along the heads; it has none for ``scaled_dot_product_attention`` on CPU). A
    whole k or v of K kv heads under ``enable_gqa`` (or one head broadcast over the query
    heads) with tp a multiple of K is cut to the copy of the kv head the rank's query heads
    read (:class:`~.placements.CopiedHeads`). Else CONFLICT."""
    q, k, v = node.args[:3]
    wants, sharded = {}, False
    for a in (q, k, v):
        p = placement(prop, a)
        if p == Shard(heads):
            sharded = True
            wants[a] = p
            continue
        n = int(expr(shape(a)[heads])) if expr(shape(a)[heads]).is_number else 0
        if p != REPLICATE or not n:
            return CONFLICT
        if n % tp == 0:
            wants[a] = Shard(heads)
        elif a is not q and tp % n == 0 and (node.kwargs.get("enable_gqa") or n == 1):
            wants[a] = CopiedHeads(heads, n)
        else:
            return CONFLICT
    if not sharded:
        return CONFLICT
    return Wants(tuple(wants.get(a, placement(prop, a)) for a in tensor_args(node)), Shard(heads))


def _gqa_kv(node, prop, k, v) -> None:
    """SDPA with ``enable_gqa``: query head ``h`` reads kv head ``h // (H / K)``, so a rank's
    even block of query heads reads exactly its block of kv heads, or its copy of one kv
    head when tp > K (replicated_heads): the kv heads behave as after repeat_kv."""
    marks = [prop.heads[a.name] for a in (k, v) if a.name in prop.heads]
    for m in marks:
        prop.kv_weights |= m.weights
    prop.claimed.add(node.name)


def _matmul(node, prop, tp):
    """Batched matmul sharded along one batch dim: both operands sharded there, or one
    sharded and the other replicated with size 1 there (it broadcasts: multi-query
    attention's one k head against a rank's block of query heads; DTensor's matmul strategy
    for a broadcast batch dim)."""
    a, b = node.args[:2]
    pa, pb = dim_of(prop, a), dim_of(prop, b)
    ra, rb, ro = len(shape(a)), len(shape(b)), len(shape(node))
    if ra < 3 or rb < 3:
        return CONFLICT
    if pa is not None and pb is not None:
        if ra != rb or pa != pb or pa >= ra - 2:
            return CONFLICT
        _one_copied_head(node, prop, a, b, pa)
        return Shard(pa + ro - ra)
    (s, ps, rs), (o, ro_) = ((a, pa, ra), (b, rb)) if pa is not None else ((b, pb, rb), (a, ra))
    if ps is None or ps >= rs - 2 or placement(prop, o) != REPLICATE:
        return CONFLICT
    k = ps - rs + ro_  # the other operand's dim aligned with the shard (right-aligned)
    if k >= 0 and not same(shape(o)[k], 1):
        return CONFLICT
    return Shard(ps + ro - rs)


def _one_copied_head(node, prop, a, b, d: int) -> None:
    """A copied kv head of size 1 along ``d`` (multi-query k or v, every rank holding it)
    against the rank's block of query heads: the matmul broadcasts it, as SDPA's
    ``enable_gqa`` does (:func:`_gqa_kv`), and its output is the rank's heads, not a copy."""
    marks = {x: prop.heads.get(x.name) for x in (a, b)}
    copied = [x for x, m in marks.items() if m is not None and m.replicated]
    if len(copied) != 1 or not same(shape(copied[0])[d], 1):
        return
    other = b if copied[0] is a else a
    if same(shape(other)[d], 1):
        return
    prop.kv_weights |= marks[copied[0]].weights
    prop.claimed.add(node.name)


def _einsum(node, prop, tp):
    """``einsum`` (kept whole by capture; DTensor has no strategy for it): the operands
    sharded along one letter that the output keeps (attention's ``"bhid,bhjd->bhij"`` over
    heads split across ranks) give the output sharded along it, each rank computing its
    slice. Every operand holding that letter must be sharded along it (a replicated operand
    of size 1 there broadcasts; one of full size is asked for sharded, :func:`request_einsum`);
    one sharded along a contracted letter, a diagonal or copied kv heads: CONFLICT (the next
    run gathers)."""
    found = _einsum_letter(node, prop)
    if found is None:
        return CONFLICT
    operands, spelled, out, c = found
    for o, ls in zip(operands, spelled):
        if c in ls and dim_of(prop, o) is None and not same(shape(o)[ls.index(c)], 1):
            return CONFLICT
    return Shard(out.index(c))


def _einsum_letter(node, prop):
    """(operands, their letters, the output's, the one letter the sharded operands are
    sharded along, kept once by the output and held once by every operand), or None."""
    eq, operands = node.args[0], node.args[1] if len(node.args) > 1 else None
    if not isinstance(eq, str) or not isinstance(operands, (list, tuple)) or not all(
            is_tensor(o) for o in operands):
        return None
    if any(o.name in prop.heads and prop.heads[o.name].replicated for o in operands):
        return None
    read = einsum_letters(eq, [len(shape(o)) for o in operands])
    if read is None:
        return None
    spelled, out = read
    letter = {ls[dim_of(prop, o)] for o, ls in zip(operands, spelled)
              if dim_of(prop, o) is not None}
    if len(letter) != 1:
        return None
    c = letter.pop()
    if c not in out or out.count(c) != 1 or any(ls.count(c) > 1 for ls in spelled):
        return None
    return operands, spelled, out, c


def request_einsum(node, prop, groups, tp: int) -> None:
    """An einsum whose sharded operands agree on a letter the output keeps, met by a
    replicated operand holding that letter at full size (Transformer-XL's relative position
    table ``"ibhd,jhd->ijbh"`` read by head-sharded queries): ask the next run to shard that
    operand's source along it (:func:`.heads.request_heads`), as an elementwise op asks for
    a broadcast operand; when every sharded operand is an even split and tp divides the
    size, the rank's piece of the source is its even block."""
    if node.target is not aten.einsum.default:
        return
    found = _einsum_letter(node, prop)
    if found is None:
        return
    operands, spelled, _, c = found
    if not all(even_split(prop, o) for o in operands if dim_of(prop, o) is not None):
        return
    for o, ls in zip(operands, spelled):
        size = shape(o)[ls.index(c)] if c in ls else None
        if dim_of(prop, o) is None and isinstance(size, int) and size > 1 and size % tp == 0:
            request_heads(prop, o, ls.index(c), groups)


def _softmax(node, prop, tp):
    d = dim_of(prop, node.args[0])
    return CONFLICT if dim_arg(node, 1) == d else shard(d)


def _reduce(node, prop, tp):
    d = dim_of(prop, node.args[0])
    rank = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    dims = [x % rank for x in ([dims] if isinstance(dims, int) else dims)]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if d in dims:
        return CONFLICT
    return shard(d) if keep else Shard(d - sum(1 for x in dims if x < d))


def _getitem(node, prop, tp):
    p = placement(prop, node.args[0])
    return p[node.args[1]] if isinstance(p, PerOutput) else p


def _masked_fill(node, prop, tp):
    return pointwise_rule(node, prop, tp)


RULES = {
    **{op: _same for op in _SAME_AS_INPUT},
    **{op: view_rule for op in _VIEWS},
    **{op: _softmax for op in _SOFTMAX},
    **{op: _reduce for op in _REDUCE},
    **{op: split_rule for op in _SPLITS},
    aten.expand.default: expand_rule,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze, aten.squeeze.default: _squeeze,
    aten.slice.Tensor: slice_rule,
    aten.select.int: _select,
    aten.unfold.default: _unfold,
    aten.cat.default: _cat,
    aten.scaled_dot_product_attention.default: _sdpa,
    **{op: _index_add for op in (aten.index_add.default, aten.index_add_.default,
                                 aten.index_copy.default, aten.index_copy_.default)},
    aten.matmul.default: _matmul, aten.bmm.default: _matmul,
    aten.einsum.default: _einsum,
    aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    aten.where.self: pointwise_rule, aten.where.ScalarOther: pointwise_rule,
    aten.embedding.default: embedding_rule,
    aten.index.Tensor: index_rule,
    aten.repeat.default: repeat_rule,
    aten.repeat_interleave.self_int: repeat_interleave_rule,
    aten.view_as_complex.default: complex_view_rule, aten.view_as_real.default: complex_view_rule,
    aten.flatten.using_ints: flatten_rule,
    operator.getitem: _getitem,
    **{op: grouped_conv_rule for op in CONVS},
    aten.batch_norm.default: batch_norm_rule, aten.instance_norm.default: batch_norm_rule,
    aten.group_norm.default: group_norm_rule,
}

# Rules that are nothing but a placement map: DTensor's strategy answers these ops first
# (analysis/sharding/propagate.py), the rule only where DTensor has none (``where.ScalarOther``,
# ``lift_fresh_copy``, ...). The others decide layouts, rewrite constants or request
# per-head tensors, which DTensor does not express.
DTENSOR_FIRST = frozenset({_same, pointwise_rule, _masked_fill, _transpose, _permute, _unsqueeze,
                           _squeeze, _select, _unfold, _cat, _matmul, _softmax, _reduce,
                           complex_view_rule, flatten_rule})

# rules asked again where DTensor's strategy would redistribute: a batched matmul whose
# replicated operand broadcasts along the sharded batch dim (multi-query attention's one k
# head; DTensor 2.13 shards both operands there or neither)
OURS_AFTER_DTENSOR = frozenset({_matmul})

# elementwise rules whose replicated operand may be sharded like the sharded one (heads.request_broadcast)
BROADCASTING = frozenset({pointwise_rule, _masked_fill})

# rules through which a raw value stays raw, and replicated kv heads stay replicated (a
# reduction only over other dims, e.g. a per-head q/k norm's mean over head_dim, keeps each
# rank's copy whole: propagate._consume_markers keeps no mark on a Replicate output)
KEEP_RAW = frozenset({_same, pointwise_rule, _masked_fill, view_rule, _transpose, _permute,
                      _unsqueeze, _squeeze, slice_rule, _select})
KEEP_HEADS = frozenset({_same, pointwise_rule, _masked_fill, _transpose, _permute, _unsqueeze,
                        _squeeze, slice_rule, _select, _unfold, _cat, split_rule, _getitem,
                        complex_view_rule, flatten_rule, _reduce})
