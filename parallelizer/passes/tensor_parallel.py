"""tensor_parallel pass: apply a TPDecision to the graph (Megatron-LM §3).

- ``f`` (copy_to_tp_region) before column_parallel linears, one per distinct input, so
  q/k/v (or gate/up) share one all-reduce of their input gradient in backward; the same f
  on the other edges where a replicated activation enters sharded compute
  (``decision.f_edges``, derived by planning/gradients.py), one per producer.
- row_parallel ``linear(x, W, b)`` becomes ``reduce_from_tp_region(linear(x, W)) + b`` (and
  GPT-2's Conv1D ``addmm(b, x, W)`` becomes ``reduce_from_tp_region(mm(x, W)) + b``; a
  ``matmul(x, W.T)`` is followed by g and its separate bias add then reads g's output): the
  bias is added once, after the all-reduce, not once per rank.
- int shape constants on sharded dims (heads, hidden, split sizes of a fused q|k|v, the kv
  heads and ``n_rep`` of repeat_kv) become the local sizes the planner computed.
- a replicated per-head value the planner marked (``decision.narrows``: BLOOM's ALiBi slopes
  before their repeat over the batch) is followed by ``scatter_to_tp_region``, each rank
  keeping its block of heads.
- the redistributions where no sharded rule takes a value as it is
  (``decision.redistributions``): ``gather_from_tp_dim`` / ``scatter_to_tp_region`` /
  ``scatter_copies_to_tp_region`` / ``scatter_pieces_to_tp_region`` before the readers
  named, ``reduce_partial_from_tp`` after an op with a Partial output.
Parameter shapes themselves are the checkpoint's business (plan ``tp_dim``); the graph only
reads them with get_attr.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..plan.decisions import TP_OPERATOR, TPDecision
from ..runtime.expert_parallel import ep_dispatch
from ..runtime.one_channel_conv import conv_one_channel
from ..runtime.tp import (copy_to_tp_region, gather_from_tp_dim, reduce_from_tp_region,
                          reduce_partial_from_tp, scatter_copies_to_tp_region,
                          scatter_pieces_to_tp_region, scatter_to_tp_region)
from ..analysis.graph_facts import aten
from ..analysis.linears import Linear, linear_sites


def apply_tensor_parallel(gm: fx.GraphModule, decision: TPDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if not decision.column and not decision.row:
        return False
    graph = gm.graph
    _copy_global_sizes(graph, decision.size_copies)
    rewrite_constants(graph, decision.rewrites)
    _one_channel_convs(graph, decision.rewrites)
    _insert_narrows(graph, decision.narrows)
    reduced = _insert_redistributions(graph, decision.redistributions)
    sites = linear_sites(graph)
    _insert_fs(graph, _f_readers(graph, sites, decision, reduced))
    for site in sites:
        if site.weight in decision.row:
            _insert_g(graph, site)
    graph.lint()
    gm.recompile()
    return True


def _copy_global_sizes(graph: fx.Graph, copies: dict) -> None:
    """Before a size node is rewritten to its local value, the ops on replicated values it
    also sizes read a copy of it that keeps the global value."""
    by_name = {n.name: n for n in graph.nodes}
    for name, users in copies.items():
        size = by_name[name]
        with graph.inserting_after(size):
            copy = graph.node_copy(size)
        copy.meta = dict(size.meta)
        for u in users:
            by_name[u].replace_input_with(size, copy)


def rewrite_constants(graph: fx.Graph, rewrites: dict) -> None:
    by_name = {n.name: n for n in graph.nodes}
    for name, edits in rewrites.items():
        node = by_name[name]
        args = list(node.args)
        for arg_index, list_index, new in edits:
            if isinstance(arg_index, str):  # a keyword argument (output_size)
                node.kwargs = {**node.kwargs, arg_index: new}
                continue
            if list_index is None:  # a scalar argument (split size)
                args[arg_index] = new
                continue
            sizes = list(args[arg_index])
            sizes[list_index] = new
            args[arg_index] = sizes
        node.args = tuple(args)


_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)


def _one_channel_convs(graph: fx.Graph, rewrites: dict) -> None:
    """A conv whose groups the plan made local and which reads one input channel per rank
    runs as :func:`conv_one_channel` (torch's oneDNN backward of such a conv corrupts the
    heap on the CPU; runtime/one_channel_conv.py)."""
    for node in graph.nodes:
        if node.name in rewrites and node.target in _CONVS and len(node.args) > 6 \
                and node.args[6] == 1 and _local_channels(node) == 1:
            node.target = conv_one_channel


def _local_channels(conv: fx.Node):
    """The input channels a rank's conv reads: the weight's dim 1 (C / groups) times the
    rank's groups (1 here); None for an unbatched input (``aten.convolution`` takes a batch)
    or values not known."""
    x, w = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in conv.args[:2])
    if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or x.dim() != w.dim():
        return None
    return w.shape[1]


def _insert_narrows(graph: fx.Graph, narrows: dict) -> None:
    by_name = {n.name: n for n in graph.nodes}
    for name, dim in narrows.items():
        node = by_name[name]
        with graph.inserting_after(node):
            cut = graph.call_function(scatter_to_tp_region, (node, dim))
        cut.meta = dict(node.meta)
        node.replace_all_uses_with(cut, delete_user_cb=lambda u, c=cut: u is not c)


_CUTS = {"scatter": scatter_to_tp_region, "scatter_copies": scatter_copies_to_tp_region}
_WHERE = ("nn_module_stack", "stack_trace", "source_fn_stack", "fwd_nn_module_stack")


def _insert_redistributions(graph: fx.Graph, redistributions: list) -> dict:
    """The redistributions, producer by producer (``redistributions`` sorts a producer's
    all-reduce before its cuts): a Partial value reduced and then cut for a reader (Partial ->
    Replicate -> Shard) is cut from the reduced value, which is what that reader then reads.
    Returns producer name -> its ``reduce_partial_from_tp`` node (what its readers read now)."""
    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    reduced: dict = {}  # producer name -> its reduce_partial_from_tp node
    for r in redistributions:
        node = by_name[r.producer]
        if r.kind == "all_reduce":
            with graph.inserting_after(node):
                new = graph.call_function(reduce_partial_from_tp, (node, r.reduce_op))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new, delete_user_cb=lambda u, c=new: u is not c)
            reduced[r.producer] = new
            continue
        node = reduced.get(r.producer, node)
        readers = [_reading(by_name[n], node) for n in r.readers]
        first = min(readers, key=order.__getitem__)
        with graph.inserting_before(first):
            new = graph.call_function(gather_from_tp_dim, (node, r.dim, r.inner)) \
                if r.kind == "all_gather" else graph.call_function(
                    scatter_pieces_to_tp_region, (node, r.dim, r.runs)) \
                if r.kind == "scatter_pieces" else graph.call_function(_CUTS[r.kind], (node, r.dim))
        # the value's meta, in the reader's module and line (a parameter has neither: the
        # block and stage splits place a node by its module)
        new.meta = {**node.meta, **{k: first.meta[k] for k in _WHERE if k in first.meta}}
        for u in readers:
            u.replace_input_with(node, new)
    return reduced


# operators the expert_parallel pass (run before this one) puts on an expert region's inputs
_ENTERING = (copy_to_tp_region, ep_dispatch)


def _reading(reader: fx.Node, value: fx.Node) -> fx.Node:
    """The node that reads ``value`` for ``reader``: the reader itself, or the operator the
    expert_parallel pass put between them (an expert region's f, its ep dispatch), which the
    redistribution then feeds: ``f(all_gather(x))``, so that the f sums the split experts'
    Partial gradient before the gather's backward takes the rank's slice (Muse-Spark's
    experts read a norm over a column linear's sharded output; the gather was left unread
    and the experts read the shard)."""
    todo = [reader]
    while todo:
        n = todo.pop()
        if value in n.all_input_nodes:
            return n
        todo += [a for a in n.all_input_nodes if a.op == "call_function" and a.target in _ENTERING]
    return reader


def _f_readers(graph: fx.Graph, sites: list, decision: TPDecision, reduced: dict) -> dict:
    """value -> the nodes reading it through one f: the column linears it feeds, and the
    sharded-compute readers of the derived f edges (``decision.f_edges``). A producer whose
    Partial output is all-reduced (``reduced``: its ``reduce_partial_from_tp`` node) is read
    after that all-reduce, so the f goes after it: a mean over the sharded heads subtracted
    from them (``k - k.mean(1, keepdim=True)``) is all-reduced forward and its gradient, each
    rank's heads' share, is all-reduced backward before the all-reduce's own backward."""
    readers: dict = {}
    for site in sites:
        if site.weight in decision.column:
            readers.setdefault(site.x, []).append(site.node)
    by_name = {n.name: n for n in graph.nodes}
    for producer, names in decision.f_edges.items():
        value = reduced.get(producer, by_name[producer])
        for u in (by_name[n] for n in names):
            mine = readers.setdefault(_gathered_for(u, value), [])
            if u not in mine:
                mine.append(u)
    return readers


def _gathered_for(reader: fx.Node, value: fx.Node) -> fx.Node:
    """What ``reader`` reads of ``value``: the value, or its all-gather where a planned gather
    stands between them (the f then goes after the gather: ``f(all_gather(v))``, its
    all-reduce summing the ranks' shares of the gathered value's gradient before the
    gather's backward takes the rank's slice)."""
    if value in reader.all_input_nodes:
        return value
    return next((g for g in reader.all_input_nodes
                 if g.target is gather_from_tp_dim and g.args[0] is value), value)


def _insert_fs(graph: fx.Graph, readers: dict) -> None:
    """One f per value, before its first reader (so q/k/v, or gate/up, share one all-reduce
    of their input gradient), read by those readers only."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    firsts = {x: min(users, key=order.__getitem__) for x, users in readers.items()}
    for x in sorted(readers, key=lambda v: order[firsts[v]]):
        with graph.inserting_before(firsts[x]):
            f = graph.call_function(copy_to_tp_region, (x,))
        # in its first reader's module: an f on a value of the block before (an activation
        # entering the next block's sharded compute) belongs to the block that reads it
        f.meta = {**x.meta, **{k: firsts[x].meta[k] for k in _WHERE if k in firsts[x].meta}}
        f.meta[TP_OPERATOR] = "f"
        for u in readers[x]:
            assert x in u.all_input_nodes, f"f on {x.name}: {u.name} does not read it"
            u.replace_input_with(x, f)


def _insert_g(graph: fx.Graph, site: Linear) -> None:
    lin = site.node
    if lin.target is aten.addmm.default:  # Conv1D: addmm(b, x, W) -> mm(x, W), b after g
        bias = lin.args[0]
        with graph.inserting_before(lin):
            partial = graph.call_function(aten.mm.default, (site.x, lin.args[2]))
            partial.meta = dict(lin.meta)
    else:
        bias = lin.args[2] if len(lin.args) > 2 else None
        lin.args = lin.args[:2]
        partial = lin
    with graph.inserting_after(partial):
        reduced = graph.call_function(reduce_from_tp_region, (partial,))
        reduced.meta = dict(lin.meta)
        reduced.meta[TP_OPERATOR] = "g"
    last = reduced
    if bias is not None:
        with graph.inserting_after(reduced):
            last = graph.call_function(aten.add.Tensor, (reduced, bias))
            last.meta = dict(lin.meta)
    for user in list(lin.users):
        if user is not reduced:
            user.replace_input_with(lin, last)
    if partial is not lin:
        graph.erase_node(lin)
