"""(batch, heads) merges: a sharded heads dim merged with the dims before it into one dim
(BLOOM's ``reshape(B, H, T, D) -> (B * H, T, D)`` before ``baddbmm``/``bmm``).

Element ``b * H + h`` of the merged dim lives on the rank holding head ``h``, so each rank's
piece is ``b * (H / tp) + h_local``: DTensor's ``_StridedShard`` (torch 2.13,
torch/distributed/tensor/_ops/_view_ops.py, a flattened dim whose inner part is sharded).
The placement stays the merged dim's index; ``prop.strided`` records that the dim is such a
merge (with the global heads), so only ops that treat it element by element carry it (the
batched matmuls, elementwise ops, transposes of other dims), a view that splits it back into
(batch, heads) gives the plain Shard again, and a value sharded the plain way never meets it.

The merged size constant becomes local: an int ``B * H`` is divided by tp, a size computed
as ``sym_size * H`` (``operator.mul``) has its ``H`` rewritten (every view using that size
node must be such a merge, checked after the run).

A replicated operand with the full merged dim (BLOOM's ALiBi ``(B * H, 1, T)``, the slopes
per head repeated over the batch) is traced back through same-shape ops to the ``repeat``
that tiled it; the repeat's input (per head) is then cut by each rank to its block of heads
(``narrow``: :func:`parallelizer.runtime.tp.scatter_to_tp_region`, a Replicate -> Shard
with no communication), and the repeat of that block is strided like the other operands.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...plan.layouts import Fused
from ..graph_facts import aten, expr, is_tensor, module_path, prod, same, shape
from ..linears import VIEWS, full_slice
from .placements import CONFLICT, REPLICATE, PerOutput, Shard
from .state import add_constraint, add_rewrite, dim_arg, dim_of, inputs_of, placement, sizes_arg

_SAME = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
         aten.alias.default, aten.detach.default, aten.type_as.default}


def merge_view(node, prop, tp, d):
    """view/reshape merging the sharded dim ``d`` (innermost) with dims before it; or
    splitting it into (heads, head_dim) and merging the heads with the dims before it
    (``nn.MultiheadAttention``'s ``q.view(L, B * H, head_dim)`` of q (L, B, E))."""
    src = node.args[0]
    ins, outs = shape(src), shape(node)
    if src.name in prop.strided or not expr(ins[d]).is_number:
        return CONFLICT
    merged = _merged_at(ins, outs, d, 0) or _merged_at(ins, outs, d, 1)
    if merged is None:
        return CONFLICT
    e, head_dim = merged
    if int(expr(ins[d])) % head_dim:
        return CONFLICT
    heads = int(expr(ins[d])) // head_dim
    add_constraint(prop, heads, "heads", module_path(node),
                   f"dim {e} of the {_op(node)} (batch and heads merged)")
    if not local_merged_size(node, prop, e, heads, tp):
        return CONFLICT
    prop.strided[node.name] = heads
    return Shard(e)


def _merged_at(ins, outs, d, split) -> tuple | None:
    """(e, head_dim): output dim ``e`` merges dims before ``d`` with dim ``d`` (``split`` 0)
    or with its outer part, its inner part ``outs[e + 1]`` being head_dim (``split`` 1)."""
    e = next((e for e in range(len(outs) - split)
              if same(prod(outs[:e + 1 + split]), prod(ins[:d + 1]))), None)
    if e is None or not any(same(prod(ins[:a]), prod(outs[:e])) for a in range(d)):
        return None
    head_dim = expr(outs[e + 1]) if split else 1
    if split and (not head_dim.is_number or int(head_dim) < 2):
        return None
    return e, int(head_dim)


def strided_features(prop, x, site):
    """The layout of a row linear's input features where they are a merge of (P, heads),
    the heads inner and sharded (``a.permute(0, 2, 3, 1).reshape(B, T, head_dim * heads)``
    of attention's (B, heads, T, head_dim) output; zoo 20 Z8): element ``p * heads + h`` on
    the rank holding head ``h`` is ``fused [heads] x P`` (each rank its block of every part),
    the layout the row weight's input dim then takes. None where the merged dim is not the
    input's features (a (batch, heads) merge) or their size is not a multiple of the heads."""
    last = len(shape(x)) - 1
    n, heads = expr(shape(x)[last]), prop.strided[x.name]
    if site.merged is not None or placement(prop, x) != Shard(last) or not n.is_number \
            or int(n) % heads:
        return None
    return Fused((heads,) * (int(n) // heads))


def strided_view(node, prop, tp, d):
    """A view of a merged value: one that splits it back into (.., heads) gives the plain
    Shard of the heads dim; one that keeps the dim keeps the merge."""
    src = node.args[0]
    ins, outs = shape(src), shape(node)
    heads = prop.strided[src.name]
    sizes = sizes_arg(node)
    e = next((e for e in range(len(outs)) if same(prod(outs[:e + 1]), prod(ins[:d + 1]))), None)
    if e is None:
        return _heads_outer(node, prop, tp, d, heads)
    if same(prod(outs[:e]), prod(ins[:d])):  # the merged dim kept as it is
        if not local_merged_size(node, prop, e, heads, tp):
            return CONFLICT
        prop.strided[node.name] = heads
        return Shard(e)
    if not same(outs[e], heads):
        return CONFLICT
    add_constraint(prop, heads, "heads", module_path(node), f"dim {e} of the {_op(node)}")
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        add_rewrite(prop, node, 1, e, heads // tp)
    elif e < len(sizes) and isinstance(sizes[e], fx.Node):
        return CONFLICT
    return Shard(e)


def _heads_outer(node, prop, tp, d, heads):
    """A view splitting the merged dim into (batch, heads), the batch merged with the dims
    before it and the heads with the dims after (``nn.MultiheadAttention``'s
    ``attn.transpose(0, 1).view(L * B, E)`` of (L, B * H, head_dim)): element ``b * H + h``
    goes to output dim ``e`` at ``h * rest + ...``, heads outermost, so the output is the
    plain Shard(e) of whole heads; the size at ``e`` becomes local."""
    ins, outs = shape(node.args[0]), shape(node)
    batch = expr(ins[d]) / heads
    e = next((e for e in range(len(outs)) if same(prod(outs[:e]), prod(ins[:d]) * batch)), None)
    if e is None or not any(same(outs[e], heads * prod(ins[d + 1:k])) for k in range(d + 1, len(ins) + 1)):
        return CONFLICT
    sizes = sizes_arg(node)
    size = sizes[e] if e < len(sizes) else None
    if isinstance(size, int) and size != -1:
        add_rewrite(prop, node, 1, e, size // tp)
    elif size != -1:
        return CONFLICT
    add_constraint(prop, heads, "heads", module_path(node), f"dim {e} of the {_op(node)}")
    return Shard(e)


def local_merged_size(node, prop, e, heads, tp) -> bool:
    """Rewrite the size at dim ``e`` of a view merging ``heads`` (sharded) with other dims
    to its local value; False when it is neither an int nor ``sym_size * heads``."""
    sizes = sizes_arg(node)
    size = sizes[e] if e < len(sizes) else None
    if isinstance(size, int):
        if size != -1:
            add_rewrite(prop, node, 1, e, size // tp)
        return True
    if isinstance(size, fx.Node) and _merged_size_read(size, prop, heads):
        prop.strided_sizes.setdefault(size.name, set()).add(node.name)
        prop.local_sizes.add(size.name)
        return True
    if isinstance(size, fx.Node) and size.target is operator.mul:
        at = [i for i, a in enumerate(size.args) if isinstance(a, int) and a == heads]
        if at:
            add_rewrite(prop, size, at[0], None, heads // tp)
            prop.strided_sizes.setdefault(size.name, set()).add(node.name)
            return True
    return False


def _merged_size_read(size: fx.Node, prop, heads: int) -> bool:
    """``size`` is ``sym_size`` of a value merged with the same heads, at its merged dim
    (einops' ``rearrange`` of a packed ``(b * h, n, d)`` sizing by ``t.shape[0]``): read at
    run time from the rank's piece, it is already the local size."""
    if size.target is not aten.sym_size.int or not isinstance(size.args[0], fx.Node):
        return False
    src = size.args[0]
    return prop.strided.get(src.name) == heads \
        and dim_of(prop, src) == size.args[1] % len(shape(src))


def repeat_rule(node, prop, tp):
    """repeat: a sharded dim repeated once stays; repeated ``r`` times (the batch tiled over
    per-head values: ``b * H + h``) it becomes a merge with the heads inner."""
    src = node.args[0]
    d = dim_of(prop, src)
    repeats = list(node.args[1])
    k = d + len(repeats) - len(shape(src))
    if isinstance(repeats[k], int) and repeats[k] == 1:
        return Shard(k)
    if src.name in prop.strided:
        return CONFLICT
    prop.strided[node.name] = int(expr(shape(src)[d]))
    return Shard(k)


def tiled_by(a: fx.Node, prop):
    """The ``repeat`` whose tiling of a sharded dim made ``a`` strided, followed back through
    single strided inputs; None when ``a`` is not strided or no one path leads to it."""
    while a.name in prop.strided:
        if a.op == "call_function" and a.target is aten.repeat.default:
            return a
        back = [b for b in inputs_of(a) if b.name in prop.strided]
        if len(back) != 1:
            return None
        a = back[0]
    return None


def carry_strided(node, prop, out) -> bool:
    """After a rule: the merge marker follows a sharded dim the op keeps (False: a merged
    value met a plain shard, or merges of different heads)."""
    kinds = {prop.strided.get(a.name) for a in inputs_of(node) if _sharded(placement(prop, a))}
    if kinds == {None} or not kinds:
        return True
    if len(kinds) > 1:
        return False
    if node.name not in prop.strided and _sharded(out):
        prop.strided[node.name] = kinds.pop()
    return True


def _sharded(p) -> bool:
    """A Shard, or a multi-output op's placements with one (the pieces of a chunk along
    head_dim of a merged value, ESM's rotate_half: each piece keeps the merge)."""
    return isinstance(p, Shard) or isinstance(p, PerOutput) and any(
        isinstance(o, Shard) for o in p.outputs)


def check_sizes(graph, prop) -> list:
    """Size nodes rewritten (or read local) for a merge that also size other ops. An op on
    replicated values only (``nn.MultiheadAttention`` reshaping its key_padding_mask,
    expanded over the heads, by the same ``bsz * num_heads`` it merges q with) gets a copy of
    the size node that keeps the global value (``prop.size_copies``: size node -> those
    ops), unless the size is read local; any other: a (node name, views, reason) conflict."""
    by_name = {n.name: n for n in graph.nodes}
    out = []
    for name, views in prop.strided_sizes.items():
        others = [u for u in by_name[name].users if u.name not in views
                  and not _slices_merged_whole(u, prop)]
        sharded = [u.name for u in others if any(placement(prop, a) != REPLICATE
                                                 for a in inputs_of(u) if is_tensor(a))]
        if sharded:
            out.append((sharded[0], views, f"the size {name} (batch x heads) also sizes "
                                           f"{sharded[0]}, which is not a (batch, heads) merge"))
        elif others and name in prop.local_sizes:  # read local: no copy holds the global
            out.append((others[0].name, views, f"the size {name} (batch x heads, read from "
                                               f"the rank's piece) also sizes {others[0].name}"))
        elif others:
            prop.size_copies[name] = tuple(u.name for u in others)
    return out


def _slices_merged_whole(node, prop) -> bool:
    """``node`` slices a merged value's merged dim whole (einops' ``unpack``: ``[0:b * h]``),
    its end that size: made local, the end is the rank's piece's size, still the whole."""
    return node.target is aten.slice.Tensor and full_slice(node) \
        and node.args[0].name in prop.strided and dim_of(prop, node.args[0]) == dim_arg(node, 1)


def request_narrow(node, prop, groups) -> None:
    """``node`` could not take a merged operand with a replicated one of the full merged
    size: ask the next run to cut the per-head value the replicated one was tiled from."""
    merged = [a for a in inputs_of(node)
              if a.name in prop.strided and dim_of(prop, a) is not None]
    if not merged:
        return
    a = merged[0]
    d = dim_of(prop, a)
    size = shape(a)[d]
    for b in inputs_of(node):
        if not is_tensor(b) or placement(prop, b) != REPLICATE:  # a conflict is no replica
            continue
        k = d - (len(shape(a)) - len(shape(b)))
        if k < 0 or not same(shape(b)[k], size):
            continue
        # copies, elementwise ops of it alone (graph-transformer-pytorch's ``~mask``) and
        # views to the same shape (torchscale's ``rel_pos.view(attn.size())``)
        while b.op == "call_function" and (b.target in _SAME or _unary(b) or b.target in VIEWS
                                           and all(same(x, y) for x, y in zip(shape(b),
                                                                               shape(b.args[0])))
                                           and len(shape(b)) == len(shape(b.args[0]))):
            b = b.args[0]
        if b.op == "call_function" and b.target in VIEWS:
            _request_merged(b, k, prop.strided[a.name], prop, groups)
            continue
        if b.op != "call_function" or b.target is not aten.repeat.default:
            continue
        inner = b.args[0]
        kk = k - (len(b.args[1]) - len(shape(inner)))
        if kk >= 0 and same(shape(inner)[kk], prop.strided[a.name]) and _fixed(shape(inner)[kk]):
            prop.narrow_requests[inner.name] = (kk, frozenset(groups))


def _unary(node) -> bool:
    """An elementwise op of one tensor, of its shape (``~mask``, ``-bias``)."""
    tensors = [a for a in node.all_input_nodes if is_tensor(a)]
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) and len(tensors) == 1 \
        and tensors[0] is node.args[0] and tuple(shape(node)) == tuple(shape(tensors[0]))


def _request_merged(b, k, heads, prop, groups) -> None:
    """``b`` is a view merging dims of its input with a heads dim innermost into its dim
    ``k`` (``nn.MultiheadAttention``'s key_padding_mask ``expand(B, H, 1, S).reshape(B * H,
    1, S)``): ask the next run to cut that input along its heads dim, so the view is a
    (batch, heads) merge like the other operands."""
    inner = b.args[0]
    ins, outs = shape(inner), shape(b)
    for j in range(1, len(ins)):
        if same(ins[j], heads) and _fixed(ins[j]) and same(prod(ins[:j + 1]), prod(outs[:k + 1])) \
                and any(same(prod(ins[:i]), prod(outs[:k])) for i in range(j)):
            prop.narrow_requests[inner.name] = (j, frozenset(groups))
            return


def _fixed(size) -> bool:
    """A size the model fixes (a heads count), not the batch's or the sequence's symbol: only
    such a dim is cut to each rank's heads."""
    return expr(size).is_Integer


def narrowed(node, prop):
    """A value each rank cuts to its block along ``dim`` (requested by :func:`request_narrow`)."""
    dim, groups = prop.narrow[node.name]
    add_constraint(prop, int(expr(shape(node)[dim])), "heads", module_path(node),
                   f"dim {dim} of {node.target} (cut to the rank's heads)")
    return Shard(dim), groups


def _op(node) -> str:
    return node.target.__name__.split(".")[0]
