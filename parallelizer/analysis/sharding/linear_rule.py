"""The linear rule of sharding propagation (:mod:`.propagate`): Megatron's column and row
parallel linears (Shoeybi et al. 2019, section 3), whatever op spells the product
(:mod:`parallelizer.analysis.linears`), with the constraints, layouts and redistributions they
record."""
from __future__ import annotations

import torch

from ...plan.layouts import InterleavedHeads, in_units
from ..graph_facts import module_path, shape
from ..linears import computed_bias, weight_path
from . import redistribute
from .pieces import site_key
from .placements import REPLICATE, Shard
from .strided import strided_features
from .state import add_constraint, conflict, mark_not_replicable, placement, record_use


def column_features(site) -> int:
    """The output features a column_parallel ``site`` computes (its piece's, if it reads
    one)."""
    return site.part[1] - site.part[0] if site.part else int(site.features(site.out_dim))


def linear_rule(node, site, prop, column, row, groups):
    """The placement of linear ``site``'s output (``node``) and the layer groups it joins: a
    column_parallel weight on a replicated input gives Shard(-1) (its raw features, whose
    later uses decide the layout), a row_parallel one on Shard(-1) gives Replicate (Partial,
    resolved by the g after it); a replicated weight keeps an input sharded on a dim the
    product does not contract. Anything else is a conflict, with the redistribution DTensor
    would insert asked of the next run."""
    if site is None:  # aten.linear on a weight that is not a parameter
        return _computed_weight(node, prop, groups)
    x, wt = site.x, site.weight
    px = placement(prop, x)
    mod = module_path(node)
    if x.name in prop.raw:
        record_use(prop, prop.raw[x.name], None, node)
    if x.name in prop.heads:
        mark_not_replicable(prop, [prop.heads[x.name]], node)
    laid = strided_features(prop, x, site) if x.name in prop.strided and wt in row else None
    if x.name in prop.strided and laid is None:
        return conflict(prop, node, groups, "a linear got a (batch, heads) merged input")
    if wt in column:
        key = site_key(site)  # the weight, or the piece of it this linear reads
        n = prop.features[key] = column_features(site)
        if key not in prop.layouts:
            add_constraint(prop, n, "features", mod, f"out_features of {key}", {key})
        if wt not in prop.no_replication and _rounded(site):
            prop.not_replicable.add(wt)  # copies' gradients summed after rounding: not the model's
        if site.merged is not None:  # the checkpoint cuts the parameter's own dim
            _merged_cut(prop, node, site, site.out_dim, prop.layouts.get(key), groups | {wt})
        if px != REPLICATE:
            redistribute.gather_all(node, prop, [x])
            return conflict(prop, node, groups, "column_parallel linear needs a replicated input")
        bias = computed_bias(site)
        if bias is not None and _bias_unplaced(node, prop, bias, key):
            return conflict(prop, node, groups, "a column_parallel linear's bias computed in "
                                                 "forward must be cut as its outputs are")
        prop.raw[node.name] = frozenset({key})
        return Shard(len(shape(node)) - 1), groups | {wt}
    if wt in row:
        add_constraint(prop, site.features(site.in_dim), "features", mod, f"in_features of {wt}",
                       origin={wt})
        if site.merged is not None:
            _merged_cut(prop, node, site, site.in_dim, None, groups)
        last = len(shape(x)) - 1
        if px != Shard(last):
            if px == REPLICATE:  # each rank takes its block of the input features
                redistribute.cut(node, prop, x, last)
            else:
                redistribute.gather_all(node, prop, [x])
            # an input no column's shard reaches names no group, and a conflict naming none
            # drops every group (a grouped FFN's shuffle took the attention with it): the
            # row's own group is to blame then
            blamed = groups if groups & (column | row) else groups | {wt}
            return conflict(prop, node, blamed, "row_parallel linear needs Shard(-1) input")
        prop.row_uses.add(wt)  # its input features' layout is its own: one for every read
        record_use(prop, {wt}, laid, node)
        return REPLICATE, groups  # Partial, resolved by the g after it at once
    if _uncontracted(px, x, site):
        return px, groups
    if px != REPLICATE:
        redistribute.gather_all(node, prop, [x])
        return conflict(prop, node, groups, "replicated linear got a sharded input")
    return REPLICATE, groups


def _computed_weight(node, prop, groups):
    """``aten.linear`` of a weight computed in forward (``F.linear(x, A @ B)``, a LoRA merge
    ``W + A @ B``): Replicate where its input, weight and bias all are; else each sharded one
    is gathered and the groups that reach them are blamed. Its weight's shard is no role:
    ``A @ B`` read as a column linear of B shards the weight's input features, which the
    input's replicated features then did not match (a zoo's internal error)."""
    sharded = [a for a in node.args[:3] if isinstance(a, torch.fx.Node)
               and placement(prop, a) != REPLICATE]
    if not sharded:
        return REPLICATE, groups
    redistribute.gather_all(node, prop, sharded)
    what = "input" if sharded == [node.args[0]] else "weight computed in forward"
    return conflict(prop, node, groups, f"replicated linear got a sharded {what}")


def _bias_unplaced(node, prop, bias, key: str) -> bool:
    """The bias ``node`` adds, computed in forward, is not yet the rank's piece of the column
    linear ``key``'s outputs: a replicated one is asked to be cut by that linear's layout
    (redistribute.lay_out), False when it is already read so."""
    pb = placement(prop, bias)
    if pb == Shard(0) and prop.raw.get(bias.name) == frozenset({key}):
        return False
    if pb == REPLICATE:
        redistribute.lay_out(node, prop, bias, 0, key)
    return True


def _uncontracted(px, x, site) -> bool:
    """A replicated 2-D weight applied to an input sharded on a dim the product does not
    contract (a per-head product ``x.view(B, T, H, d) @ P`` on a rank's heads, Linformer's
    ``E(k.transpose(1, 2))`` on a rank's features) keeps that shard in the output, whose
    leading dims are the input's: DTensor's strategy for ``mm`` with a sharded batch dim
    and a replicated other side (planning/tp_seeds.py ``_within_pair`` leaves such a weight
    out of the pairs). Its gradient is then Partial (analysis/gradients.py), summed over tp."""
    if not isinstance(px, Shard) or site.batched or site.merged is not None:
        return False
    rank = len(shape(x))
    return px.dim % rank != rank - 1


def _merged_cut(prop, node, site, dim: int, layout, groups) -> None:
    """The weight matrix's layout along ``dim`` of a merged parameter (:attr:`Linear.merged`)
    must be a cut of that dim. Evenly: tp divides it (a constraint on it as on heads, so
    the planner may keep the linear whole where tp is a multiple of it, decision 68). Else a
    conflict (the linear's pair kept replicated) when a run of the layout splits a row
    group (:func:`parallelizer.plan.layouts.in_units`); it does not stop the linear's rule,
    so the layouts found stay the same from round to round."""
    size = int(shape(site.param)[dim])
    text = "x".join(str(d) for d in shape(site.param))
    if size == int(site.features(dim)):  # the dim is the features (a pointwise conv's
        return  # (O, C, 1, 1) viewed (O, C)): the features' constraint names it
    if layout is None or isinstance(layout, InterleavedHeads):
        origin = {site.weight} if site.weight in groups else set()
        add_constraint(prop, size, "heads", module_path(node),
                       f"dim {dim} of {site.weight} ({text})", origin=origin)
        return
    try:
        in_units(layout, int(site.features(dim)) // size)
    except ValueError as e:
        prop.conflicts.append((node.name, module_path(node), groups,
                               f"{site.weight} ({text}) is cut along its dim {dim} ({e})"))


def _rounded(site) -> bool:
    """The weight path casts the parameter to a floating dtype of less precision (a fake
    quantisation, ``w.to(torch.bfloat16).to(x.dtype)``): a copy of its kv heads on several
    ranks would have each rank's gradient rounded before the copies are summed, where the
    model rounds their sum, so its kv heads are not copied (the projection is kept whole
    and attention cuts each rank's copy, decision 68)."""
    own = site.param.meta["val"].dtype
    if not own.is_floating_point:
        return False
    for n in weight_path(site.w_node):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point \
                and torch.finfo(v.dtype).eps > torch.finfo(own).eps:
            return True
    return False
