"""Sharding propagation for tensor parallelism (DESIGN §3).

Given which linear weights are column_parallel and which row_parallel, walk the graph in
order and give every tensor value a placement over the tp mesh dim (:mod:`.placements`):
``Replicate()`` or ``Shard(d)`` (of the *global* shape recorded by export). A row_parallel
linear turns Shard(-1) into Partial, which the Megatron g operator resolves at once, so
Partial never flows on. Ops without a rule accept only Replicate inputs; a sharded value reaching
one is a *conflict*, never a silent mis-sharding. A conflict asks the next run for the
redistribution DTensor would insert (:mod:`.redistribute`: an all-gather, a cut of a
replicated value, an all-reduce of a Partial output); where none can resolve it the planner
keeps that layer group replicated and says so in the report.

Integer shape constants in view/reshape/expand that land on a sharded dim (the heads or the
hidden size) are recorded for division by the tp degree, and every sharded size is recorded
as a divisibility constraint, so a tp degree that does not divide the heads fails at compile
time with the module named.

Layouts (:mod:`parallelizer.plan.layouts`) are decided here too, from how a column linear's output
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

This module is the driver (``propagate``); the linear rule is in :mod:`.linear_rule`, the
per-op rules in :mod:`.rules`, those deciding layouts in :mod:`.layouts`, (batch, heads)
merges in :mod:`.strided`, the recorded state in :mod:`.state`. DTensor's
op strategies (torch/distributed/tensor/_ops, :mod:`.dtensor`) answer first for the
ops whose rule is only a placement map and for the ops the table lacks; the table keeps
what DTensor does not express (layouts, shape constants, copied kv heads, per-head tensors).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..graph_facts import aten, is_tensor, module_path, same, shape, source_line
from ...frontend.vmap_regions import vmapped
from ..linears import as_linear, reads_parameters
from .dtensor import NO_RULE, Wants, dtensor_rule
from . import redistribute
from .channels import channel_reader
from .heads import factory_rule, request_broadcast, request_written
from ...plan.layouts import InterleavedHeads
from .cuts import fuse_slices
from .one_head import SEARCH_LIMIT, copied_whole_unsqueeze, one_head_unsqueeze
from .layouts import view_rule
from .placements import (CONFLICT, COPIED_WHOLE, REPLICATE, Conflict, CopiedWhole, Shard,
                         shard_dim)
from .rules import (BROADCASTING, DTENSOR_FIRST, KEEP_HEADS, KEEP_RAW, OURS_AFTER_DTENSOR, RULES,
                    pointwise_rule, request_einsum)
from .strided import tiled_by, carry_strided, check_sizes, narrowed, request_narrow
from .pieces import register, site_key
from .weights import path_rule, weight_paths
from .state import (HeadsMark, Propagation, add_constraint, conflict, dim_of, inputs_of,
                    mark_not_replicable, placement, record_use)
from .linear_rule import column_features, linear_rule

__all__ = ["CONFLICT", "Propagation", "propagate"]


def propagate(graph: fx.Graph, column: set, row: set, tp: int, layouts: Optional[dict] = None,
              no_replication=frozenset(), per_head: Optional[dict] = None,
              narrow: Optional[dict] = None, edges: Optional[dict] = None,
              reduces: Optional[dict] = None) -> Propagation:
    """Placements for every node of ``graph`` under the given column/row weight sets.

    Args:
        column: weight FQNs (get_attr targets) of column_parallel linears; their weights are
            sharded on the output-features dim (0 for nn.Linear, 1 for GPT-2's Conv1D).
        row: weight FQNs of row_parallel linears, sharded on the input-features dim.
        tp: tp degree (divides shape constants in the rewrites).
        layouts: column weight fqn -> layout assumed for the rewrites (the ``found_layouts``
            of the previous run); missing means the even split.
        no_replication: weights whose kv heads must not be replicated (a previous run found
            the replicated value reaching an op other than repeat_kv); a dict names, for
            each, that op (the reports say it).
        per_head: ``("param", fqn)`` / ``("factory", node name)`` -> (dim, column groups):
            per-head tensors to shard along their heads dim (the ``head_requests`` of
            previous runs, :mod:`.heads`).
        narrow: node name -> (dim, column groups): replicated per-head values each rank cuts
            to its block of heads (the ``narrow_requests`` of previous runs,
            :mod:`.strided`).
        edges: consumer node name -> {producer node name: placement it reads it in}, and
        reduces: node name -> reduce op of the all-reduce after it: the redistributions of
            previous runs (the ``edge_requests`` / ``reduce_requests``, :mod:`.redistribute`).
    """
    prop = Propagation(layouts=dict(layouts or {}), no_replication=frozenset(no_replication),
                       no_replication_at=dict(no_replication) if isinstance(
                           no_replication, dict) else {},
                       narrow=dict(narrow or {}), edges={k: dict(v) for k, v in
                                                         (edges or {}).items()},
                       reduces=dict(reduces or {}))
    for (kind, name), v in (per_head or {}).items():
        (prop.per_head if kind == "param" else prop.per_head_factories)[name] = v
    weight_dims, paths, bias_readers = {}, {}, {}
    for node in graph.nodes:
        site = as_linear(node)
        if site and site.weight in column:
            weight_dims[site.weight] = site.out_dim
            register(prop, site)
            prop.features[site_key(site)] = column_features(site)  # read by its bias's path
            if site.bias_add is not None:  # a separate bias add: the bias is Shard(0), raw
                prop.column_biases[site.bias] = (site.weight, site_key(site))
        elif site and site.weight in row:
            weight_dims[site.weight] = site.in_dim
        if site:
            paths.update(weight_paths(site, column, row))
            if site.bias:
                bias_readers.setdefault(site.bias, []).append(site)
    _shared_biases(prop, bias_readers, column, row)
    inside = vmapped(graph)
    for node in graph.nodes:
        with redistribute.seen(node, prop):
            if node.name in paths:  # a weight read through casts, views, transposes
                placement, groups = path_rule(node, prop, tp, paths[node.name])
            elif node in inside and node.op == "call_function":
                placement, groups = _in_vmap(node, prop, column | row, inside[node])
            else:
                placement, groups = _rule(node, prop, column, row, weight_dims, tp)
        prop.placements[node.name] = placement
        # a replicated value (e.g. after g) carries no shard: a conflict further down the
        # residual stream must not blame the pairs upstream of it
        prop.groups[node.name] = frozenset() if placement == REPLICATE else groups
    _copies_met_whole(graph, prop)
    fuse_slices(prop, tp)
    prop.kv_weights -= prop.no_replication  # their heads are not copied: tp divides them
    _mark_kv_heads(prop)
    for name, views, reason in check_sizes(graph, prop):
        groups = frozenset().union(*[prop.groups.get(v, frozenset()) for v in views])
        prop.conflicts.append((name, "", groups, reason))
    return prop


def _copies_met_whole(graph: fx.Graph, prop) -> None:
    """A part held whole (:class:`~.placements.CopiedWhole`: one kv head every rank holds)
    read by an op computed whole on every rank: that op's gradient for the part is the
    whole gradient on each rank, not the rank's query heads' share, so the copies' sum over
    tp would count it tp times (palm-pytorch's v when its attention was gathered, zoo 12
    F6). Its copies are refused (``not_replicable``: the next run splits the part), and the
    projection is offered kept whole (``one_head_dim``: tp_candidates.one_head_whole, its
    readers then cutting the rank's heads from it)."""
    for node in graph.nodes:
        if node.op != "call_function" or type(placement(prop, node)) is not type(REPLICATE) \
                or not _holds_tensors(node):
            continue
        for a in inputs_of(node):
            if isinstance(placement(prop, a), CopiedWhole) and a.name in prop.copied_whole:
                weights = prop.copied_whole[a.name]
                mark_not_replicable(prop, [HeadsMark(weights, 1, True)], node)
                prop.one_head_dim |= weights


def _in_vmap(node: fx.Node, prop, sharded: set, level: fx.Node):
    """An op inside a ``torch.vmap`` level (``frontend/vmap_regions``) runs replicated: tp's
    f and g and every redistribution are autograd Functions, which refuse to run there
    ("it must override the setup_context staticmethod"). A sharded input or a sharded
    linear's weight is a conflict blaming its groups (they are kept whole)."""
    groups = frozenset().union(*[prop.groups.get(a.name, frozenset()) for a in inputs_of(node)])
    site = as_linear(node)
    if site is not None and site.weight in sharded:
        groups |= {site.weight}
    if _sharded_inputs(node, prop) or (site is not None and site.weight in sharded):
        where = source_line(level)
        return conflict(prop, node, groups, f"it runs inside torch.vmap"
                        f"{' (at ' + where + ')' if where else ''}, where tp's operators "
                        f"(autograd Functions) cannot run")
    return REPLICATE, groups


def _output(node: fx.Node, prop, groups):
    """The graph's outputs are the model's, whole on every rank: a sharded one (the residual
    stream of a block whose last op is an elementwise op of a sharded operand, DiT's
    ``x + gate.unsqueeze(1) * mlp(..)`` with the gate a column linear's shard) is gathered
    before it is returned. No rule read the output node, so each rank returned its shard
    (the compile's numerics self-check: an internal error). Asked for here, the all-gather
    is read by the next run (a conflict until then, as for any op's redistribution)."""
    if not _sharded_inputs(node, prop):
        return REPLICATE, groups
    requested = redistribute.gather_all(node, prop)
    return conflict(prop, node, groups, "the model returns it sharded" + (
        "" if requested else ", and no all-gather can stand in (not an even split of it)"))


def _shared_biases(prop, readers: dict, column, row) -> None:
    """A bias whose pieces are read by the linears of several weights (torch's kdim/vdim
    q/k/v weights with ``in_proj_bias.chunk(3)``) is sharded only with all of them column
    parallel (a row_parallel one adds its piece whole, after the all-reduce)."""
    for bias, sites in readers.items():
        sharded = {s.weight for s in sites if s.weight in column}
        if sharded and len(sharded) < len({s.weight for s in sites}):
            site = next(s for s in sites if s.weight not in column)
            other = "row_parallel" if site.weight in row else "replicated"
            prop.conflicts.append((site.node.name, module_path(site.node), frozenset(sharded),
                                   f"its bias {bias} is shared with the {other} linear "
                                   f"{site.weight}"))


def _mark_kv_heads(prop) -> None:
    """GQA kv projections split evenly (tp divides their heads) are recorded as
    ``interleaved_heads`` with their head_dim, so a converter knows which dim holds kv heads
    and can copy them (``replicated_heads``) for a tp above their count."""
    for w in prop.kv_weights:
        uses = prop.uses.get(w, {})
        if w in prop.head_shapes and set(uses) == {None}:
            heads, head_dim = prop.head_shapes[w]
            prop.uses[w] = {InterleavedHeads(heads, head_dim): uses[None]}


def _rule(node: fx.Node, prop: Propagation, column, row, weight_dims, tp):
    groups = frozenset().union(*[prop.groups.get(a.name, frozenset()) for a in inputs_of(node)])
    if node.op == "get_attr":
        if node.target in column:
            return Shard(weight_dims[node.target]), frozenset({node.target})
        if node.target in row:
            return Shard(weight_dims[node.target]), frozenset()
        if node.target in prop.per_head:
            d, g = prop.per_head[node.target]
            reader = channel_reader(node)
            add_constraint(prop, shape(node)[d], "channels" if reader else "heads",
                           module_path(reader or node), f"dim {d} of the per-"
                           f"{'channel' if reader else 'head'} {node.target}")
            return Shard(d), g
        if node.target in prop.column_biases:
            w, key = prop.column_biases[node.target]
            prop.raw[node.name] = frozenset({key})
            return Shard(0), frozenset({w})
        return REPLICATE, frozenset()
    if node.op == "output":
        return _output(node, prop, groups)
    if node.op != "call_function":
        return REPLICATE, groups
    ins = _sharded_inputs(node, prop)
    if any(isinstance(placement(prop, a), Conflict) for a in ins):
        return CONFLICT, groups
    site = as_linear(node)
    if site is not None or node.target is aten.linear.default:
        return linear_rule(node, site, prop, column, row, groups)
    if node.name in prop.per_head_factories:
        return factory_rule(node, prop, tp), prop.per_head_factories[node.name][1]
    if node.target is aten.unsqueeze.default and node.args[0].name in prop.copied_whole:
        out = copied_whole_unsqueeze(node, prop)  # one head held whole, spread over heads
        if out is not None:
            return out, groups
    if node.name in prop.narrow and not ins:  # a cut of a replicated value only
        return narrowed(node, prop)
    if not ins:
        return _replicated(node, prop), groups
    if not _holds_tensors(node):  # sizes (SymInt) and other non-tensor values
        return REPLICATE, groups
    if node.target is aten.unsqueeze.default:  # before DTensor: one kv head to copy
        out = one_head_unsqueeze(node, prop)
        if out is not None:
            return out, groups
    fn = RULES.get(node.target)
    if fn is None:
        tags = getattr(node.target, "tags", ())
        fn = pointwise_rule if torch.Tag.pointwise in tags else dtensor_rule
    copies = _copies_only(node, prop) if fn is dtensor_rule or fn in DTENSOR_FIRST else None
    if copies is not None and fn not in KEEP_HEADS:
        out = _on_copies(node, prop, copies)
        if out == CONFLICT:
            return conflict(prop, node, groups, "a per-head operand meets copied kv heads")
        if out is not None:
            return out, groups
    source = dtensor_rule if fn in DTENSOR_FIRST and copies is None and \
        not _copied_heads_in(node, prop) else fn
    out = redistribute.reduced(node, prop, source(node, prop, tp))
    if out is NO_RULE and source is not fn:  # DTensor has no strategy: our rule
        source, out = fn, fn(node, prop, tp)
    elif out == CONFLICT and source is not fn and fn in OURS_AFTER_DTENSOR:
        mine = fn(node, prop, tp)  # a case DTensor's strategy does not take (a broadcast)
        if isinstance(mine, Shard):
            source, out = fn, mine
    if copies is not None and (out is NO_RULE or out == CONFLICT):
        found = _on_copies(node, prop, copies)
        if found == CONFLICT:
            return conflict(prop, node, groups, "a per-head operand meets copied kv heads")
        if found is not None:
            return found, groups
    why, requested = "", False
    if out is NO_RULE or out == CONFLICT:
        request_narrow(node, prop, groups)
        if fn in BROADCASTING:
            request_broadcast(node, prop, groups, tp)
        request_einsum(node, prop, groups, tp)
        requested = request_written(node, prop, groups, tp) or \
            redistribute.request(node, prop, tp, out)
        why = "" if requested else redistribute.why_not(node, prop)
    elif fn is not view_rule and not carry_strided(node, prop, out):
        # tiled heads (GQA by ``k.repeat(1, n_rep, 1, 1)``: query head h reads kv head
        # h % kv) meeting plain heads: the repeat reads its input gathered, and what meets
        # the plain shards is replicated (attention then cuts it to the rank's heads)
        for a in ins:
            r = tiled_by(a, prop)
            if r is not None:
                redistribute.gather_all(r, prop, [r.args[0]])
        return conflict(prop, node, groups, "a (batch, heads) merged dim meets a dim sharded "
                                             "another way")
    if out is NO_RULE or out == CONFLICT:
        if not requested:  # else the next run reads the inputs redistributed, marks and all
            _consume_markers(node, prop, None, CONFLICT)
    if out is NO_RULE:
        return conflict(prop, node, groups, f"no sharding rule for {node.target} (ours or "
                                             f"DTensor's){why}")
    if out == CONFLICT:
        return conflict(prop, node, groups, f"{node.target} cannot take a sharded input here"
                         + (" (DTensor's strategy would redistribute it)"
                            if source is dtensor_rule else "") + why)
    _consume_markers(node, prop, fn, out)
    return out, groups


def _replicated(node, prop):
    """Replicate; CopiedWhole for what a part held whole computes from itself and values
    without a gradient (PaLM's rotary on its one k head before the heads dim), carrying its
    weights to the unsqueeze or einsum that places it."""
    held = [prop.copied_whole[a.name] for a in inputs_of(node) if a.name in prop.copied_whole]
    if not held or not _holds_tensors(node):
        return REPLICATE
    # sizes read off a value (``expand_as(k)``'s ``sym_size``s: F.normalize) carry none
    whole = all(a.name in prop.copied_whole or not is_tensor(a)
                or not reads_parameters(a, SEARCH_LIMIT) for a in inputs_of(node))
    if whole:
        prop.copied_whole[node.name] = frozenset().union(*held)
        return COPIED_WHOLE
    return REPLICATE


def _copies_only(node, prop):
    """The copied kv heads every sharded input of ``node`` holds (one mark, weights merged),
    or None (no sharded input, or one sharded otherwise)."""
    marks = [prop.heads.get(a.name) for a in _sharded_inputs(node, prop)]
    if not marks or any(m is None or not m.replicated or m.expanded for m in marks) \
            or len({m.heads for m in marks}) != 1:
        return None
    return HeadsMark(frozenset().union(*[m.weights for m in marks]), marks[0].heads, True)


def _on_copies(node, prop, mark):
    """Copied kv heads (K heads at tp a multiple of K: rank r holds head r // (tp / K)) are
    DTensor's even ``Shard`` over a mesh of K ranks, rank r standing in for rank r // (tp /
    K): so DTensor's strategy on that mesh answers any op on them (GLM's interleaved rotary:
    stack then flatten of the rank's head), the local sizes it gives are the copy's. Kept
    when it shards the output along a dim of K entries (the output's heads, still copied);
    else None."""
    out = dtensor_rule(node, prop, mark.heads)
    if isinstance(out, Wants) and not out.partial and redistribute.cut_copies(node, prop, out,
                                                                             mark.heads):
        return CONFLICT  # the next run reads the per-head operand cut to the copies
    if type(out) is not Shard or not same(shape(node)[out.dim], mark.heads):
        return None
    prop.claimed.add(node.name)
    prop.heads[node.name] = mark
    return out


def _copied_heads_in(node, prop) -> bool:
    """An input holds copied kv heads: a "Shard" whose every rank holds the whole dim (or one
    of K heads), which DTensor's placements do not express; our rule answers."""
    return any(prop.heads[a.name].replicated for a in inputs_of(node) if a.name in prop.heads)


def _sharded_inputs(node, prop):
    """Inputs placed anything but Replicate (PerOutput and Conflict included)."""
    return [a for a in inputs_of(node) if placement(prop, a) != REPLICATE]


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
        if (fn in KEEP_RAW or _along_other_dims(node, prop, fn, out)) \
                and len(raw) == len(sharded) and not _moves_dim(node, prop, fn, out):
            prop.raw[node.name] = weights
        else:
            record_use(prop, weights, None, node)
    marks = [prop.heads[a.name] for a in sharded if a.name in prop.heads]
    if marks:
        if fn in KEEP_HEADS and len(marks) == len(sharded) and len(
                {(m.heads, m.replicated, m.expanded) for m in marks}) == 1 \
                and not marks[0].expanded and out != REPLICATE:
            # one kind of mark; a per-head operand cut to the copies adds no weights
            prop.heads[node.name] = HeadsMark(frozenset().union(*[m.weights for m in marks]),
                                              marks[0].heads, marks[0].replicated)
        else:
            mark_not_replicable(prop, marks, node)


def _along_other_dims(node, prop, fn, out) -> bool:
    """An op DTensor's strategy keeps sharded on the input's dim at the same size, one input
    and the output of its shape (Vision Mamba's ``xz.flip([1])`` along the sequence): it
    moves values along other dims only, so the features are the linear's as they were."""
    ins = [a for a in inputs_of(node) if dim_of(prop, a) is not None]
    if fn is not dtensor_rule or len(ins) != 1 or type(out) is not Shard:
        return False
    return out.dim == dim_of(prop, ins[0]) and shape(node) == shape(ins[0])


def _moves_dim(node, prop, fn, e) -> bool:
    """A view that changes the sharded dim's size (it no longer holds whole output features)."""
    if fn is not view_rule:
        return False
    d, e = dim_of(prop, node.args[0]), shard_dim(e)
    return e is None or not same(shape(node.args[0])[d], shape(node)[e])


def _holds_tensors(node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor)
