"""Sharding propagation for tensor parallelism (DESIGN §3).

Given which linear weights are column_parallel and which row_parallel, walk the graph in
order and give every tensor value a placement over the tp mesh dim: ``None`` (Replicate) or
an int ``d`` (Shard(d) of the *global* shape recorded by export). A row_parallel linear
turns Shard(-1) into Partial, which the Megatron g operator resolves at once, so Partial
never flows on. Ops without a rule accept only Replicate inputs; a sharded value reaching
one is a *conflict*, never a silent mis-sharding: the planner then keeps that layer group
replicated and says so in the report.

Integer shape constants in view/reshape/expand that land on a sharded dim (the heads or the
hidden size) are recorded for division by the tp degree, and every sharded size is recorded
as a divisibility constraint, so a tp degree that does not divide the heads fails at compile
time with the module named.

Rules follow DTensor's op strategies (torch/distributed/tensor/_ops) restricted to one mesh dim.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .graph_facts import aten, expr, is_tensor, module_path, prod, same, shape

INVALID = "invalid"

_SAME_AS_INPUT = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.dropout.default,
    aten.type_as.default, aten.lift_fresh_copy.default, aten.to.device,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
            aten._log_softmax.default}
_REDUCE = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unbind.int}


@dataclass(frozen=True)
class Constraint:
    """A global size that must be divisible by the tp degree."""
    size: int
    what: str      # "heads", "features", ...
    module: str    # module FQN
    detail: str


@dataclass
class Propagation:
    placements: dict = field(default_factory=dict)   # node name -> None | int | tuple
    groups: dict = field(default_factory=dict)       # node name -> frozenset of column fqns
    rewrites: dict = field(default_factory=dict)     # node name -> [(arg, index, new_int)]
    conflicts: list = field(default_factory=list)    # (node name, module, groups, reason)
    constraints: list = field(default_factory=list)  # Constraint


def propagate(graph: fx.Graph, column: set, row: set, tp: int) -> Propagation:
    """Placements for every node of ``graph`` under the given column/row weight sets.

    Args:
        column: weight FQNs (get_attr targets) of column_parallel linears, Shard(0) weights.
        row: weight FQNs of row_parallel linears, Shard(1) weights.
        tp: tp degree (divides shape constants in the rewrites).
    """
    prop = Propagation()
    for node in graph.nodes:
        placement, groups = _rule(node, prop, column, row, tp)
        prop.placements[node.name] = placement
        # a replicated value (e.g. after g) carries no shard: a conflict further down the
        # residual stream must not blame the pairs upstream of it
        prop.groups[node.name] = frozenset() if placement is None else groups
    return prop


def _inputs(node):
    return [a for a in node.all_input_nodes]


def _pl(prop, n):
    return prop.placements.get(n.name) if isinstance(n, fx.Node) else None


def _rule(node: fx.Node, prop: Propagation, column, row, tp):
    groups = frozenset().union(*[prop.groups.get(a.name, frozenset()) for a in _inputs(node)])
    if node.op == "get_attr":
        if node.target in column:
            return 0, frozenset({node.target})
        if node.target in row:
            return 1, frozenset()
        return None, frozenset()
    if node.op != "call_function":
        return None, groups
    ins = [a for a in _inputs(node) if _pl(prop, a) is not None]
    if any(_pl(prop, a) == INVALID for a in ins):
        return INVALID, groups
    target = node.target
    if target is aten.linear.default:
        return _linear(node, prop, column, row, groups)
    if not ins:
        return None, groups
    if not _holds_tensors(node):  # sizes (SymInt) and other non-tensor values
        return None, groups
    fn = _RULES.get(target)
    if fn is None:
        tags = getattr(target, "tags", ())
        fn = _pointwise if torch.Tag.pointwise in tags else None
    if fn is None:
        return _conflict(prop, node, groups, f"no sharding rule for {target}")
    out = fn(node, prop, tp)
    if out == INVALID:
        return _conflict(prop, node, groups, f"{target} cannot take a sharded input here")
    return out, groups


def _holds_tensors(node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor)


def _conflict(prop, node, groups, reason):
    prop.conflicts.append((node.name, module_path(node), groups, reason))
    return INVALID, groups


def _linear(node, prop, column, row, groups):
    x, w = node.args[0], node.args[1]
    wt = w.target if isinstance(w, fx.Node) and w.op == "get_attr" else None
    px = _pl(prop, x)
    mod = module_path(node)
    if wt in column:
        _constraint(prop, shape(w)[0], "features", mod, f"out_features of {wt}")
        if px is not None:
            return _conflict(prop, node, groups, "column_parallel linear needs a replicated input")
        return len(shape(node)) - 1, groups | {wt}
    if wt in row:
        _constraint(prop, shape(w)[1], "features", mod, f"in_features of {wt}")
        if px != len(shape(x)) - 1:
            return _conflict(prop, node, groups, "row_parallel linear needs Shard(-1) input")
        return None, groups
    if px is not None:
        return _conflict(prop, node, groups, "replicated linear got a sharded input")
    return None, groups


def _constraint(prop, size, what, module, detail):
    prop.constraints.append(Constraint(int(size), what, module, detail))


def _same(node, prop, tp):
    return _pl(prop, node.args[0])


def _pointwise(node, prop, tp):
    """Broadcasting elementwise op: every sharded input maps to one output dim; replicated
    inputs must broadcast (size 1) along it."""
    out_rank = len(shape(node))
    dims = set()
    for a in _inputs(node):
        p = _pl(prop, a)
        if p is not None and is_tensor(a):
            dims.add(p + out_rank - len(shape(a)))
    if len(dims) != 1:
        return INVALID
    d = dims.pop()
    for a in _inputs(node):
        if is_tensor(a) and _pl(prop, a) is None:
            k = d - (out_rank - len(shape(a)))
            if k >= 0 and not same(shape(a)[k], 1):
                return INVALID
    return d


def _rewrite(prop, node, arg_index, list_index, new):
    prop.rewrites.setdefault(node.name, []).append((arg_index, list_index, new))


def _sizes_arg(node):
    return list(node.args[1])


def _view(node, prop, tp):
    """view/reshape: find the output dim that starts where the sharded input dim starts.
    Same size: the shard stays; a split (hidden -> heads, head_dim): the shard goes to the
    outer (heads) dim; a merge (heads, head_dim -> hidden): the shard goes to the merged dim.
    An int size constant on that dim is divided by tp."""
    d = _pl(prop, node.args[0])
    ins, outs = shape(node.args[0]), shape(node)
    before = prod(ins[:d])
    e = next((e for e in range(len(outs)) if same(prod(outs[:e]), before)), None)
    while e is not None and e < len(outs) - 1 and same(outs[e], 1) and not same(ins[d], 1):
        e += 1
    if e is None:
        return INVALID
    ratio_split = expr(ins[d]) / expr(outs[e])
    if not (same(ins[d], outs[e]) or ratio_split.is_integer or (1 / ratio_split).is_integer):
        return INVALID
    what = "heads" if not same(ins[d], outs[e]) else "features"
    _constraint(prop, int(expr(outs[e])), what, module_path(node),
                f"dim {e} of the {node.target.__name__.split('.')[0]} to "
                f"[{', '.join(str(o) if isinstance(o, int) else '*' for o in outs)}]")
    sizes = _sizes_arg(node)
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        _rewrite(prop, node, 1, e, sizes[e] // tp)
    return e


def _expand(node, prop, tp):
    d = _pl(prop, node.args[0])
    e = d + len(shape(node)) - len(shape(node.args[0]))
    sizes = _sizes_arg(node)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        _constraint(prop, sizes[e], "heads", module_path(node), f"dim {e} of expand")
        _rewrite(prop, node, 1, e, sizes[e] // tp)
    return e


def _dim(node, i, rank=None):
    d = node.args[i] if len(node.args) > i else node.kwargs.get("dim", 0)
    rank = len(shape(node.args[0])) if rank is None else rank
    return d % rank if isinstance(d, int) else d


def _transpose(node, prop, tp):
    d = _pl(prop, node.args[0])
    a, b = _dim(node, 1), _dim(node, 2)
    return b if d == a else a if d == b else d


def _permute(node, prop, tp):
    d = _pl(prop, node.args[0])
    order = [p % len(node.args[1]) for p in node.args[1]]
    return order.index(d)


def _unsqueeze(node, prop, tp):
    d = _pl(prop, node.args[0])
    u = node.args[1] % len(shape(node))
    return d + 1 if u <= d else d


def _squeeze(node, prop, tp):
    d = _pl(prop, node.args[0])
    ins = shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(ins) if same(s, 1)]
    dims = [x % len(ins) for x in ([dims] if isinstance(dims, int) else dims)]
    dims = [x for x in dims if same(ins[x], 1)]
    if d in dims:
        return INVALID
    return d - sum(1 for x in dims if x < d)


def _slice(node, prop, tp):
    d = _pl(prop, node.args[0])
    dim = _dim(node, 1)
    if dim != d:
        return d
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    full = start in (0, None) and (end is None or (isinstance(end, int) and end >= 2 ** 62))
    return d if full else INVALID


def _select(node, prop, tp):
    d = _pl(prop, node.args[0])
    dim = _dim(node, 1)
    return INVALID if dim == d else d - (1 if dim < d else 0)


def _cat(node, prop, tp):
    tensors = node.args[0]
    rank = len(shape(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    ps = {_pl(prop, t) for t in tensors}
    if len(ps) != 1 or None in ps or dim in ps:
        return INVALID
    return ps.pop()


def _sdpa(node, prop, tp):
    """Attention over a sharded heads dim (Megatron-LM §3: heads split across ranks)."""
    q, k, v = node.args[:3]
    heads = len(shape(q)) - 3
    if {_pl(prop, q), _pl(prop, k), _pl(prop, v)} != {heads}:
        return INVALID
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if is_tensor(mask) and _pl(prop, mask) is None:
        m = shape(mask)
        k_ = heads - (len(shape(q)) - len(m))
        if k_ >= 0 and not same(m[k_], 1):
            return INVALID
    return heads


def _matmul(node, prop, tp):
    a, b = node.args[:2]
    pa, pb = _pl(prop, a), _pl(prop, b)
    ra, rb, ro = len(shape(a)), len(shape(b)), len(shape(node))
    if pa is None or pb is None or ra < 3 or rb < 3 or ra != rb:
        return INVALID
    if pa != pb or pa >= ra - 2:
        return INVALID
    return pa + ro - ra


def _softmax(node, prop, tp):
    d = _pl(prop, node.args[0])
    return INVALID if _dim(node, 1) == d else d


def _reduce(node, prop, tp):
    d = _pl(prop, node.args[0])
    rank = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    dims = [x % rank for x in ([dims] if isinstance(dims, int) else dims)]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if d in dims:
        return INVALID
    return d if keep else d - sum(1 for x in dims if x < d)


def _split(node, prop, tp):
    d = _pl(prop, node.args[0])
    dim = _dim(node, 2) if node.target is not aten.unbind.int else _dim(node, 1)
    if dim == d:
        return INVALID
    n = len(node.meta["val"])
    if node.target is aten.unbind.int:
        return tuple((d - (1 if dim < d else 0)) for _ in range(n))
    return tuple(d for _ in range(n))


def _getitem(node, prop, tp):
    p = _pl(prop, node.args[0])
    return p[node.args[1]] if isinstance(p, tuple) else p


def _masked_fill(node, prop, tp):
    return _pointwise(node, prop, tp)


_RULES = {
    **{op: _same for op in _SAME_AS_INPUT},
    **{op: _view for op in _VIEWS},
    **{op: _softmax for op in _SOFTMAX},
    **{op: _reduce for op in _REDUCE},
    **{op: _split for op in _SPLITS},
    aten.expand.default: _expand,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze, aten.squeeze.default: _squeeze,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul,
    aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    aten.where.self: _pointwise,
    operator.getitem: _getitem,
}
