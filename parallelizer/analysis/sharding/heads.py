"""Per-head tensors (DESIGN §3, "masks and position biases added to the scores"): a value
that meets attention scores sharded over heads, but is itself replicated with a full heads
dim, is traced back to the parameter it comes from (T5's ``relative_attention_bias``
embedding, per-head scales or biases), which is then sharded along that dim; or to a
factory op (``zeros`` / ``ones`` / ``full`` of a heads-sized shape: T5's cross-attention
bias), whose heads constant becomes local. Propagation then carries the shard forward like
any other, so the rank's piece of the bias meets the rank's heads.

The same holds for any elementwise op (:func:`request_broadcast`): a learned gain per head
``(heads, 1, 1)`` multiplied into head-sharded q or k, ALiBi's slopes: the replicated
operand pairs element ``i`` of the sharded dim with the rank's
element ``i``, so its source is sharded along that dim.

Only ops whose dim mapping is unambiguous are walked back: same-shape ops, broadcasting
elementwise ops with exactly one input holding the dim at full size, unsqueeze, squeeze, permute,
transpose, expand, views that keep the dim whole, embedding (output last dim = weight dim 1)
and a gather of a table's rows (``table[idx]``: Swin's relative position bias table).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..graph_facts import aten, is_tensor, module_path, prod, same, shape, weight_fqn
from .placements import CONFLICT, REPLICATE, Shard
from .redistribute import writes_into
from .state import add_constraint, add_rewrite, dim_of, inputs_of, placement

_SAME = {aten.contiguous.default, aten.clone.default, aten.to.dtype, aten.to.device,
         aten.to.dtype_layout, aten._to_copy.default, aten.alias.default, aten.detach.default,
         aten.dropout.default, aten.type_as.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SQUEEZES = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
# x.new_*(sizes): the sizes are the second argument
_NEW = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
        aten.new_full.default}
_FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default,
              aten.empty.memory_format} | _NEW


def trace_head_source(node: fx.Node, dim: int, limit: int = 32) -> Optional[tuple]:
    """Where dim ``dim`` of ``node`` comes from: ``("param", fqn, dim)`` for a parameter or
    buffer, ``("factory", node_name, dim)`` for a zeros/ones/full, or None (ambiguous)."""
    for _ in range(limit):
        if node.op == "get_attr":
            return ("param", weight_fqn(node), dim) if is_tensor(node) else None
        if node.op != "call_function":
            return None
        t = node.target
        if t in _FACTORIES:
            size = node.args[_size_arg(node)][dim]
            return ("factory", node.name, dim) if isinstance(size, int) else None
        if t is aten.slice.Tensor:  # a slice along another dim keeps this one whole
            if (node.args[1] if len(node.args) > 1 else 0) % len(shape(node)) == dim:
                return None
            node = node.args[0]
            continue
        if t in _SAME:
            node = node.args[0]
        elif t is aten.unsqueeze.default:
            u = node.args[1] % len(shape(node))
            if u == dim:
                return None
            node, dim = node.args[0], dim - (1 if u < dim else 0)
        elif t in _SQUEEZES:
            kept = _kept_dims(node)
            if kept is None:
                return None
            node, dim = node.args[0], kept[dim]
        elif t is aten.permute.default:
            node, dim = node.args[0], node.args[1][dim] % len(shape(node))
        elif t is aten.transpose.int:
            a, b = (x % len(shape(node)) for x in node.args[1:3])
            node, dim = node.args[0], b if dim == a else a if dim == b else dim
        elif t is aten.embedding.default:
            if dim != len(shape(node)) - 1:
                return None
            node, dim = node.args[0], 1
        elif t in _VIEWS:
            found = _view_source_dim(node, dim)
            if found is None:
                return None
            node, dim = found
        elif t is aten.index.Tensor:
            found = _row_gather(node, dim)
            if found is None:
                return None
            node, dim = found
        elif t is aten.expand.default or _elementwise(t):
            found = _full_input(node, dim)
            if found is None:
                return None
            node, dim = found
        else:
            return None
    return None


def _kept_dims(node: fx.Node) -> Optional[list]:
    """The input dim of each output dim of a squeeze (Mamba's depthwise conv weight
    ``w.squeeze(1)`` unsqueezed back for ``F.conv1d``); None when its dims are not ints."""
    ins = shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(ins) if same(s, 1)]
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        return None
    gone = {d % len(ins) for d in dims if same(ins[d % len(ins)], 1)}
    return [i for i in range(len(ins)) if i not in gone]


def _view_source_dim(node: fx.Node, dim: int):
    """The input dim a view keeps as output dim ``dim``: the same size, after dims of the
    same total size (``(T * T, heads) -> (T, T, heads)``); None for a split or merged dim."""
    ins, outs = shape(node.args[0]), shape(node)
    before = prod(outs[:dim])
    e = next((e for e in range(len(ins)) if same(prod(ins[:e]), before)), None)
    if e is None or e >= len(ins) or not same(ins[e], outs[dim]):
        return None
    return node.args[0], e


def _row_gather(node: fx.Node, dim: int):
    """``table[idx]`` (one index tensor, on dim 0): the output is idx's dims, then the
    table's dims after the first, so output dim ``dim`` past idx's is the table's
    ``dim - idx.ndim + 1`` (Swin's ``relative_position_bias_table[index]``, (T * T, heads)
    out of (relative positions, heads))."""
    indices = list(node.args[1])
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or not is_tensor(indices[0]):
        return None
    k = len(shape(indices[0]))
    return (node.args[0], dim - k + 1) if dim >= k else None


def _elementwise(t) -> bool:
    return t is aten.where.ScalarOther or torch.Tag.pointwise in getattr(t, "tags", ())


def _full_input(node: fx.Node, dim: int):
    """The one tensor input that holds ``dim`` at its full size (others broadcast)."""
    size, rank = shape(node)[dim], len(shape(node))
    hits = []
    for a in node.all_input_nodes:
        if not is_tensor(a):
            continue
        k = dim - (rank - len(shape(a)))
        if k >= 0 and not same(shape(a)[k], 1):
            if not same(shape(a)[k], size):
                return None
            hits.append((a, k))
    return hits[0] if len(hits) == 1 else None


def embedding_rule(node, prop, tp):
    """embedding(weight Shard(1), indices Replicate) -> Shard(last): a per-head table."""
    w, idx = node.args[0], node.args[1]
    if placement(prop, w) == Shard(1) and placement(prop, idx) == REPLICATE:
        return Shard(len(shape(node)) - 1)
    return CONFLICT


def factory_rule(node, prop, tp):
    """A zeros/ones/full/new_empty whose heads dim the planner shards: its size constant is
    local."""
    dim = prop.per_head_factories[node.name][0]
    arg = _size_arg(node)
    sizes = list(node.args[arg])
    add_constraint(prop, int(sizes[dim]), "heads", module_path(node), f"dim {dim} of {node.target}")
    add_rewrite(prop, node, arg, dim, int(sizes[dim]) // tp)
    return Shard(dim)


def _size_arg(node) -> int:
    return 1 if node.target in _NEW else 0


def request_written(node: fx.Node, prop, groups, tp: int) -> bool:
    """``node`` writes a sharded value in place into a replicated target made by a factory op
    (keys assembled by ``copy_`` into the slices of a ``new_empty``: DeepSeek-V3's and
    MiniCPM3's ``expand_kv``). An in-place op keeps its target's placement, so DTensor would
    gather the value; the factory is sharded instead, its heads constant local, and the
    write goes sharded into sharded (:func:`request_heads`). Returns whether it asked."""
    target = next((a for a in inputs_of(node) if is_tensor(a) and writes_into(node, a)), None)
    if target is None or dim_of(prop, target) is not None:
        return False
    d = _agreed_dim(node, prop, len(shape(target)))
    src = None if d is None else trace_head_source(target, d)
    if src is None or src[0] != "factory":
        return False
    return request_heads(prop, target, d, groups)


def request_heads(prop, mask: fx.Node, dim: int, groups) -> bool:
    """Ask the planner to shard the source of ``mask``'s heads dim (next propagation run).
    Returns whether a source was found."""
    src = trace_head_source(mask, dim)
    if src is None:
        return False
    kind, name, d = src
    prop.head_requests[(kind, name)] = (d, frozenset(groups))
    return True


def request_broadcast(node: fx.Node, prop, groups, tp: int) -> None:
    """``node`` (elementwise) could not take its inputs: its sharded inputs agree on one
    output dim ``d``, but a replicated input holds ``d`` at full size. Ask the next run to
    shard that input's source along its dim (:func:`request_heads`), when every sharded
    input is an even split of ``d`` (:func:`even_split`) and tp divides the size: then the rank's
    piece of the source is its even block, as the even Shard the request gives it. A size
    tp does not divide (a gain per kv head at tp > kv heads, whose heads are copied, not
    split) is not requested: the op's conflict keeps that attention replicated (reported)."""
    rank = len(shape(node))
    d = _agreed_dim(node, prop, rank)
    if d is None:
        return
    for b in inputs_of(node):
        if not is_tensor(b) or dim_of(prop, b) is not None:
            continue
        k = d - (rank - len(shape(b)))
        size = shape(b)[k] if k >= 0 else 1
        if not same(size, 1) and same(size, shape(node)[d]) and isinstance(size, int) \
                and size % tp == 0:
            request_heads(prop, b, k, groups)


def _agreed_dim(node: fx.Node, prop, rank: int):
    """The one dim of a ``rank``-dim value (broadcast from the right) that every sharded
    input of ``node`` is sharded along, each an even split of it (:func:`even_split`), or
    None."""
    sharded = [a for a in inputs_of(node) if is_tensor(a) and dim_of(prop, a) is not None]
    dims = {dim_of(prop, a) + rank - len(shape(a)) for a in sharded}
    if len(dims) != 1 or not all(even_split(prop, a) for a in sharded):
        return None
    return dims.pop()


def even_split(prop, a: fx.Node, raw: bool = False) -> bool:
    """``a``'s sharded dim is split evenly over the tp ranks whatever layouts later runs
    find: not copied or expanded kv heads, not a merged (batch, heads) dim, and not a column
    output's raw features (their layout, fused or not, is settled only by later runs, while
    a request holds for every run after it). With ``raw``, raw features count as even: for a
    rule whose taking them records an even use of them (propagate._consume_markers), so that
    a later run laying them out otherwise meets a layout conflict, never a wrong shard."""
    mark = prop.heads.get(a.name)
    if mark is not None and (mark.replicated or mark.expanded):
        return False
    return a.name not in prop.strided and (raw or a.name not in prop.raw)
