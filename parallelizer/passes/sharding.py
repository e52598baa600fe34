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

Layouts (:mod:`parallelizer.layouts`) are decided here too, from how a column linear's output
is used. While its sharded dim is still exactly the weight's output features (a *raw*
value: through elementwise ops and same-size views), a ``split`` of that dim makes the
weight ``fused`` (GPT-2's q|k|v ``c_attn``, a fused gate|up: each rank splits its piece
into its own q, k and v), as do static slices of it (Phi-3's ``qkv[..., a:b]``: the cuts of
all slices give the parts), and a view into ``K < tp`` heads, K dividing tp, makes it
``replicated_heads`` (GQA kv heads: rank ``r`` holds head ``r // (tp / K)``). Such a
replicated value may only flow through head-preserving ops into ``repeat_kv``'s expand +
reshape, which hand each rank the (even) block of query heads it serves; anything else
marks the weight as not replicable. A split of the per-head dim after an even heads split records
``interleaved_heads`` (GPT-NeoX's per-head [q k v]: already head-aligned, recorded for
converters). Any other use of a raw value needs the even split. The planner runs propagation
again with the layouts found until they are stable, so the rewritten constants (split sizes,
views) follow the layouts.

Rules follow DTensor's op strategies (torch/distributed/tensor/_ops) restricted to one mesh dim.
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..layouts import local_length
from .graph_facts import aten, as_linear, expr, is_tensor, module_path, prod, same, shape

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
    """A global size that the tp degree must divide, or, for the heads of GQA kv projections
    (``weights`` all reach repeat_kv), divide or be a multiple of."""
    size: int
    what: str      # "heads", "features", ...
    module: str    # module FQN
    detail: str
    weights: frozenset = frozenset()  # for heads: the column weights whose output they split

    def replicable(self, kv_weights) -> bool:
        """Heads of weights whose output reaches repeat_kv (GQA kv heads) may be copied."""
        return bool(self.weights) and self.weights <= kv_weights

    def allows(self, tp: int, kv_weights=frozenset()) -> bool:
        if self.size % tp == 0:
            return True
        if not self.replicable(kv_weights):
            return False
        # the output features of a kv projection: its heads constraint decides
        return self.what == "features" or tp % self.size == 0


@dataclass
class Propagation:
    placements: dict = field(default_factory=dict)   # node name -> None | int | tuple
    groups: dict = field(default_factory=dict)       # node name -> frozenset of column fqns
    rewrites: dict = field(default_factory=dict)     # node name -> [(arg, index, new_int)]
    conflicts: list = field(default_factory=list)    # (node name, module, groups, reason)
    constraints: list = field(default_factory=list)  # Constraint
    # layouts: column weight fqn -> layout (JSON data); "even" uses are recorded as None
    uses: dict = field(default_factory=dict)         # weight fqn -> {layout json: node name}
    not_replicable: set = field(default_factory=set)  # weights whose kv heads cannot be copies
    # per-run inputs and value markers (see the module docstring)
    layouts: dict = field(default_factory=dict)      # the layouts this run assumes
    no_replication: frozenset = frozenset()
    raw: dict = field(default_factory=dict)          # node name -> frozenset of weights
    heads: dict = field(default_factory=dict)        # node name -> HeadsMark
    claimed: set = field(default_factory=set)        # nodes whose rule set the markers
    features: dict = field(default_factory=dict)     # column weight fqn -> out features
    kv_weights: set = field(default_factory=set)     # column weights whose heads reach repeat_kv
    slices: dict = field(default_factory=dict)       # column weight -> [(lo, hi, node, module)]
    head_shapes: dict = field(default_factory=dict)  # column weight -> (heads, head_dim)

    def found_layouts(self) -> dict:
        """weight fqn -> its one non-even layout (weights used in several ways excluded:
        :func:`layout_conflicts` names them)."""
        out = {}
        for w, uses in self.uses.items():
            uses = _merged(uses)
            if len(uses) == 1 and next(iter(uses)) != "null":
                out[w] = json.loads(next(iter(uses)))
        return out

    def layout_conflicts(self) -> list:
        """(weight, node name, reason) for weights whose output is used in two layouts."""
        out = []
        for w, uses in sorted(self.uses.items()):
            uses = _merged(uses)
            if len(uses) > 1:
                out.append((w, sorted(uses.values())[0], f"{w}'s output is used both as "
                            + " and as ".join(_describe(json.loads(u)) for u in sorted(uses))))
        return out


def _merged(uses: dict) -> dict:
    """interleaved_heads is the even split, recorded for converters: it absorbs even uses."""
    if "null" in uses and any('"interleaved_heads"' in u for u in uses):
        return {u: n for u, n in uses.items() if u != "null"}
    return uses


@dataclass(frozen=True)
class HeadsMark:
    """A value whose sharded dim is the heads of ``weights``' output (``heads`` globally).
    ``replicated``: each rank holds one copy of a head (tp > heads); ``expanded``: after
    repeat_kv's expand, the sharded (heads, n_rep) dim pair."""
    weights: frozenset
    heads: int
    replicated: bool
    expanded: bool = False


def _describe(layout) -> str:
    return "an evenly split tensor" if layout is None else f"a {layout['kind']} tensor"


def propagate(graph: fx.Graph, column: set, row: set, tp: int, layouts: Optional[dict] = None,
              no_replication=frozenset()) -> Propagation:
    """Placements for every node of ``graph`` under the given column/row weight sets.

    Args:
        column: weight FQNs (get_attr targets) of column_parallel linears; their weights are
            sharded on the output-features dim (0 for nn.Linear, 1 for GPT-2's Conv1D).
        row: weight FQNs of row_parallel linears, sharded on the input-features dim.
        tp: tp degree (divides shape constants in the rewrites).
        layouts: column weight fqn -> layout assumed for the rewrites (the ``found_layouts``
            of the previous run); missing means the even split.
        no_replication: weights whose kv heads must not be replicated (a previous run found
            the replicated value reaching an op other than repeat_kv).
    """
    prop = Propagation(layouts=dict(layouts or {}), no_replication=frozenset(no_replication))
    weight_dims = {}
    for node in graph.nodes:
        site = as_linear(node)
        if site and site.weight in column:
            weight_dims[site.weight] = site.out_dim
        elif site and site.weight in row:
            weight_dims[site.weight] = site.in_dim
    for node in graph.nodes:
        placement, groups = _rule(node, prop, column, row, weight_dims, tp)
        prop.placements[node.name] = placement
        # a replicated value (e.g. after g) carries no shard: a conflict further down the
        # residual stream must not blame the pairs upstream of it
        prop.groups[node.name] = frozenset() if placement is None else groups
    _fuse_slices(prop)
    _mark_kv_heads(prop)
    return prop


def _mark_kv_heads(prop) -> None:
    """GQA kv projections split evenly (tp divides their heads) are recorded as
    ``interleaved_heads`` with their head_dim, so a converter knows which dim holds kv heads
    and can copy them (``replicated_heads``) for a tp above their count."""
    for w in prop.kv_weights:
        uses = prop.uses.get(w, {})
        if w in prop.head_shapes and set(uses) == {"null"}:
            heads, head_dim = prop.head_shapes[w]
            layout = {"kind": "interleaved_heads", "heads": heads, "head_dim": head_dim}
            prop.uses[w] = {json.dumps(layout, sort_keys=True): uses["null"]}


def _inputs(node):
    return [a for a in node.all_input_nodes]


def _pl(prop, n):
    return prop.placements.get(n.name) if isinstance(n, fx.Node) else None


def _rule(node: fx.Node, prop: Propagation, column, row, weight_dims, tp):
    groups = frozenset().union(*[prop.groups.get(a.name, frozenset()) for a in _inputs(node)])
    if node.op == "get_attr":
        if node.target in column:
            return weight_dims[node.target], frozenset({node.target})
        if node.target in row:
            return weight_dims[node.target], frozenset()
        return None, frozenset()
    if node.op != "call_function":
        return None, groups
    ins = [a for a in _inputs(node) if _pl(prop, a) is not None]
    if any(_pl(prop, a) == INVALID for a in ins):
        return INVALID, groups
    site = as_linear(node)
    if site is not None or node.target is aten.linear.default:
        return _linear(node, site, prop, column, row, groups)
    if not ins:
        return None, groups
    if not _holds_tensors(node):  # sizes (SymInt) and other non-tensor values
        return None, groups
    fn = _RULES.get(node.target)
    if fn is None:
        tags = getattr(node.target, "tags", ())
        fn = _pointwise if torch.Tag.pointwise in tags else None
    if fn is None:
        _consume_markers(node, prop, None, INVALID)
        return _conflict(prop, node, groups, f"no sharding rule for {node.target}")
    out = fn(node, prop, tp)
    if out == INVALID:
        _consume_markers(node, prop, None, INVALID)
        return _conflict(prop, node, groups, f"{node.target} cannot take a sharded input here")
    _consume_markers(node, prop, fn, out)
    return out, groups


_KEEP_RAW = set()       # rules through which a raw value stays raw (filled below _RULES)
_KEEP_HEADS = set()     # rules through which replicated kv heads stay replicated


def _sharded_inputs(node, prop):
    return [a for a in _inputs(node) if _pl(prop, a) is not None]


def _consume_markers(node, prop, fn, out) -> None:
    """Carry the raw / replicated-heads markers of ``node``'s inputs to its output, or
    record what the use means for the weights behind them (see the module docstring).
    Rules that decide a layout themselves (split, the heads view, repeat_kv) have already
    marked ``node``."""
    if node.name in prop.claimed:
        return
    sharded = _sharded_inputs(node, prop)
    raw = [prop.raw[a.name] for a in sharded if a.name in prop.raw]
    if raw:
        weights = frozenset().union(*raw)
        if fn in _KEEP_RAW and len(raw) == len(sharded) and not _moves_dim(node, prop, fn, out):
            prop.raw[node.name] = weights
        else:
            _use(prop, weights, None, node)
    marks = [prop.heads[a.name] for a in sharded if a.name in prop.heads]
    if marks:
        if fn in _KEEP_HEADS and len(marks) == len(sharded) and len(set(marks)) == 1 \
                and not marks[0].expanded:
            prop.heads[node.name] = marks[0]
        else:
            _not_replicable(prop, marks)


def _not_replicable(prop, marks) -> None:
    for m in marks:
        if m.replicated:
            prop.not_replicable |= m.weights


def _moves_dim(node, prop, fn, e) -> bool:
    """A view that changes the sharded dim's size (it no longer holds whole output features)."""
    if fn is not _view:
        return False
    d = _pl(prop, node.args[0])
    return e in (None, INVALID) or not same(shape(node.args[0])[d], shape(node)[e])


def _use(prop, weights, layout, node) -> None:
    key = json.dumps(layout, sort_keys=True)
    name = node if isinstance(node, str) else node.name
    for w in weights:
        prop.uses.setdefault(w, {}).setdefault(key, name)


def _holds_tensors(node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor)


def _conflict(prop, node, groups, reason):
    prop.conflicts.append((node.name, module_path(node), groups, reason))
    return INVALID, groups


def _linear(node, site, prop, column, row, groups):
    if site is None:  # aten.linear on a weight that is not a parameter
        if _pl(prop, node.args[0]) is not None:
            return _conflict(prop, node, groups, "replicated linear got a sharded input")
        return None, groups
    x, wt = site.x, site.weight
    w = next(a for a in _inputs(node) if a.op == "get_attr" and a.target == wt)
    px = _pl(prop, x)
    mod = module_path(node)
    if x.name in prop.raw:
        _use(prop, prop.raw[x.name], None, node)
    if x.name in prop.heads:
        _not_replicable(prop, [prop.heads[x.name]])
    if wt in column:
        prop.features[wt] = int(shape(w)[site.out_dim])
        if wt not in prop.layouts:
            _constraint(prop, shape(w)[site.out_dim], "features", mod, f"out_features of {wt}",
                        {wt})
        if px is not None:
            return _conflict(prop, node, groups, "column_parallel linear needs a replicated input")
        prop.raw[node.name] = frozenset({wt})
        return len(shape(node)) - 1, groups | {wt}
    if wt in row:
        _constraint(prop, shape(w)[site.in_dim], "features", mod, f"in_features of {wt}")
        if px != len(shape(x)) - 1:
            return _conflict(prop, node, groups, "row_parallel linear needs Shard(-1) input")
        return None, groups
    if px is not None:
        return _conflict(prop, node, groups, "replicated linear got a sharded input")
    return None, groups


def _constraint(prop, size, what, module, detail, weights=frozenset()):
    prop.constraints.append(Constraint(int(size), what, module, detail, frozenset(weights)))


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
    An int size constant on that dim is divided by tp (or set to the layout's local length)."""
    src = node.args[0]
    d = _pl(prop, src)
    ins, outs = shape(src), shape(node)
    mark = prop.heads.get(src.name)
    if mark is not None and mark.replicated:
        return _merge_repeated_heads(node, prop, tp, d, mark)
    before = prod(ins[:d])
    e = next((e for e in range(len(outs)) if same(prod(outs[:e]), before)), None)
    while e is not None and e < len(outs) - 1 and same(outs[e], 1) and not same(ins[d], 1):
        e += 1
    if e is None:
        return INVALID
    ratio_split = expr(ins[d]) / expr(outs[e])
    if not (same(ins[d], outs[e]) or ratio_split.is_integer or (1 / ratio_split).is_integer):
        return INVALID
    sizes = _sizes_arg(node)
    raw = prop.raw.get(src.name)
    detail = (f"dim {e} of the {node.target.__name__.split('.')[0]} to "
              f"[{', '.join(str(o) if isinstance(o, int) else '*' for o in outs)}]")
    if same(ins[d], outs[e]):
        _constraint(prop, int(expr(outs[e])), "features", module_path(node), detail)
        local = _local_features(prop, raw, int(expr(outs[e])), tp)
    elif raw and ratio_split.is_integer:
        return _split_heads(node, prop, tp, e, raw, detail)
    else:
        _constraint(prop, int(expr(outs[e])), "heads", module_path(node), detail)
        local = int(expr(outs[e])) // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        _rewrite(prop, node, 1, e, local)
    return e


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
    head_dim = int(expr(shape(node.args[0])[_pl(prop, node.args[0])])) // heads
    replicate = heads % tp != 0 and tp % heads == 0 and not (raw & prop.no_replication)
    _constraint(prop, heads, "heads", module_path(node), detail, raw)
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(raw, heads, replicate)
    for w in raw:
        prop.head_shapes[w] = (heads, head_dim)
    sizes = _sizes_arg(node)
    if replicate:
        _use(prop, raw, {"kind": "replicated_heads", "heads": heads, "head_dim": head_dim}, node)
        local = 1
    else:
        _use(prop, raw, None, node)
        local = heads // tp
    if e < len(sizes) and isinstance(sizes[e], int) and sizes[e] != -1:
        _rewrite(prop, node, 1, e, local)
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
    _constraint(prop, heads, "heads", module_path(node), f"dim {d} of the repeat_kv reshape")
    sizes = _sizes_arg(node)
    if isinstance(sizes[d], int) and sizes[d] != -1:
        _rewrite(prop, node, 1, d, heads // tp)
    return d


def _expand(node, prop, tp):
    src = node.args[0]
    d = _pl(prop, src)
    e = d + len(shape(node)) - len(shape(src))
    sizes = _sizes_arg(node)
    mark = prop.heads.get(src.name)
    if mark is not None and _is_repeat_kv(node, d, e):
        prop.kv_weights |= mark.weights
        if mark.replicated:
            return _repeat_replicated_kv(node, prop, tp, e, mark)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        _constraint(prop, sizes[e], "heads", module_path(node), f"dim {e} of expand",
                    mark.weights if mark is not None else ())
        _rewrite(prop, node, 1, e, sizes[e] // tp)
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
    _constraint(prop, n_rep * mark.heads, "heads", module_path(node),
                f"dims {e}, {e + 1} of expand")
    sizes = _sizes_arg(node)
    if isinstance(sizes[e], int) and sizes[e] != -1:
        _rewrite(prop, node, 1, e, 1)
    if isinstance(sizes[e + 1], int) and sizes[e + 1] != -1:
        _rewrite(prop, node, 1, e + 1, n_rep * mark.heads // tp)
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
    if full:
        return d
    return _slice_part(node, prop, tp, d, start, end)


def _slice_part(node, prop, tp, d, start, end):
    """Phi-3's ``qkv[..., a:b]``: slices of a column output's features cut it into parts.
    The cuts of all slices of one weight's output give its ``fused`` parts (each slice must
    be exactly one part, checked in :func:`_fuse_slices`); the bounds become local offsets."""
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
        _rewrite(prop, node, 2, None, _local_offset(lo, layout, tp))
    if hi < n and end is not None:
        _rewrite(prop, node, 3, None, _local_offset(hi, layout, tp))
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


def _fuse_slices(prop) -> None:
    """Turn the cuts recorded by :func:`_slice_part` into one fused layout per weight."""
    for w, cuts in prop.slices.items():
        n = prop.features[w]
        bounds = sorted({0, n} | {b for lo, hi, _n, _m in cuts for b in (lo, hi)})
        parts = [b - a for a, b in zip(bounds, bounds[1:])]
        for lo, hi, name, _m in cuts:
            if bounds.index(hi) - bounds.index(lo) != 1:  # a slice spanning two parts
                _use(prop, {w}, None, name)
        for p in parts:
            _constraint(prop, p, "features", cuts[0][3], f"a part of the fused output of {w} "
                        f"(sliced into {parts})")
        _use(prop, {w}, {"kind": "fused", "parts": parts}, cuts[0][2])


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
    n = len(node.meta["val"])
    if dim == d:
        return _split_fused(node, prop, tp, d, n)
    mark = prop.heads.get(node.args[0].name)
    if mark is not None and not mark.replicated and not mark.expanded and n > 1 \
            and dim == len(shape(node.args[0])) - 1 and node.target is not aten.unbind.int:
        # GPT-NeoX: (B, T, heads, 3 * head_dim) per-head [q k v], split after the heads
        _use(prop, mark.weights, {"kind": "interleaved_heads", "heads": mark.heads}, node)
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
        _constraint(prop, p, "features", module_path(node),
                    f"a part of the fused output of {', '.join(sorted(raw))} (split {parts})")
    prop.claimed.add(node.name)
    _use(prop, raw, {"kind": "fused", "parts": parts}, node)
    size = node.args[1]
    if node.target is aten.split.Tensor and isinstance(size, int):
        _rewrite(prop, node, 1, None, size // tp)
    elif node.target is aten.split_with_sizes.default:
        for i, p in enumerate(size):
            if isinstance(p, int):
                _rewrite(prop, node, 1, i, p // tp)
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
_KEEP_RAW.update({_same, _pointwise, _masked_fill, _view, _transpose, _permute, _unsqueeze,
                  _squeeze, _slice, _select})
_KEEP_HEADS.update({_same, _pointwise, _masked_fill, _transpose, _permute, _unsqueeze,
                    _squeeze, _slice, _select, _cat, _split, _getitem})
