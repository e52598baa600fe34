"""sequence_parallel pass: apply a SequenceParallelDecision (Korthikanti et al. 2022, §4.2.2).

- g (``reduce_from_tp_region``) on a region value -> ``reduce_scatter_to_sequence_parallel_region``;
  f (``copy_to_tp_region``) reading a region value -> ``all_gather_from_sequence_parallel_region``.
- a replicated value read by the region -> ``split_to_sequence_parallel_region`` (its local
  slice), once per value (a parameter once per block reading it), read by the region's
  nodes only (:func:`enter_region`: the one place a vocab-parallel embedding's Partial
  output would be reduce-scattered instead).
- a region value read outside -> ``gather_from_sequence_parallel_region`` for those readers.
- a parameter broadcast into the region -> f on that edge (its gradient is partial over tp).
- view sizes holding the global sequence length -> the local one
  (``sequence_shard_length``, which also checks divisibility at run time).
- region dropouts -> ``random_op_on_sequence_shard`` (their slice of the full mask).

Region values get ``node.meta["sequence_shard"] = (dim, flat, tp)``: their local value is
1/tp of the recorded (global) shape along ``dim`` (split_stages reads it when it recomputes
a size from a stage input).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from ..plan.decisions import SequenceParallelDecision
from ..analysis.graph_facts import aten, block_of
from ..runtime.rng import random_op
from ..runtime.sequence import (all_gather_from_sequence_parallel_region, gathered_linears,
                                gather_from_sequence_parallel_region,
                                random_op_on_sequence_shard,
                                reduce_scatter_to_sequence_parallel_region,
                                sequence_shard_length, split_to_sequence_parallel_region)
from ..runtime.tp import copy_to_tp_region

SEQUENCE_SHARD = "sequence_shard"


def apply_sequence_parallel(gm: fx.GraphModule, d: SequenceParallelDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if not d.enabled:
        return False
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    seq = _global_seq(graph, by_name, d.seq)
    local = _local_seq(graph, seq, d.tp) if d.views else None
    region = {by_name[k] for k in d.region}

    def seq_arg(place):
        return seq if place[1] else None

    for name, place in d.reduce_scatter.items():
        n = by_name[name]
        n.target, n.args = reduce_scatter_to_sequence_parallel_region, (n.args[0], place[0], seq_arg(place))
    for name, place in d.all_gather.items():
        n = by_name[name]
        n.target, n.args = all_gather_from_sequence_parallel_region, (n.args[0], place[0], seq_arg(place))
    for name in d.all_gather:
        _fuse_linears(graph, by_name[name], d.blocks)
    for name, place in d.splits.items():
        enter_region(graph, by_name[name], place, seq_arg(place), region, d.tp, d.blocks)
    for name, readers in d.exits.items():
        _exit(graph, by_name[name], d.region[name], seq_arg(d.region[name]),
              [by_name[r] for r in readers])
    for name, a in d.param_inputs:
        n, x = by_name[name], by_name[a]
        with graph.inserting_before(n):
            f = graph.call_function(copy_to_tp_region, (x,))
        f.meta = _reader_meta(x, n)
        n.replace_input_with(x, f)
    for name, positions in d.views.items():
        n = by_name[name]
        args = list(n.args)
        for arg, index in positions:
            sizes = list(args[arg])
            sizes[index] = local
            args[arg] = sizes
        n.args = tuple(args)
    for name, place in d.dropouts.items():
        n = by_name[name]
        if n.target is random_op:
            stream, op, *rest = n.args
            n.target, n.args = random_op_on_sequence_shard, (stream, op, place[0], seq_arg(place), *rest)
    for n in region:
        n.meta[SEQUENCE_SHARD] = (*d.region[n.name], d.tp)
    _sizes_from_region(graph, region, seq)
    graph.lint()
    gm.recompile()
    return True


def _linear_kind(u: fx.Node, x: fx.Node):
    """("linear" | "addmm" | "mm", weight, bias) when ``u`` is a linear reading ``x`` as
    its input, else None."""
    if u.kwargs:
        return None
    if u.target is aten.linear.default and u.args[0] is x and x not in u.args[1:]:
        return "linear", u.args[1], (u.args[2] if len(u.args) > 2 else None)
    if u.target is aten.addmm.default and len(u.args) == 3 and u.args[1] is x \
            and x not in (u.args[0], u.args[2]):
        return "addmm", u.args[2], u.args[0]
    if u.target is aten.mm.default and u.args[0] is x and u.args[1] is not x:
        return "mm", u.args[1], None
    return None


def _fuse_linears(graph: fx.Graph, ag: fx.Node, blocks: tuple) -> None:
    """All-gather + the column_parallel linears reading it -> one ``gathered_linears`` (it
    keeps the shard for backward, not the gathered input; runtime/sequence.py) per block
    reading it, when every reader of ``ag`` in that block is such a linear whose weight and
    bias exist before the first one. One fused node never serves two blocks: it would sit
    in the first block's run and interleave the blocks (T5's decoder blocks all project the
    encoder output in their cross-attention); each block all-gathers for itself, as it
    would on its own pipeline stage."""
    order = _position(graph)
    groups: dict = {}
    for u in sorted(ag.users, key=order):
        groups.setdefault(block_of(u, blocks), []).append(u)
    shard, dim, seq = ag.args
    for users in groups.values():
        kinds = [_linear_kind(u, ag) for u in users]
        if None in kinds:
            continue
        first = users[0]
        params = [p for _k, w, b in kinds for p in (w, b)]
        if any(isinstance(p, fx.Node) and order(p) > order(first) for p in params):
            continue
        with graph.inserting_before(first):
            fused = graph.call_function(gathered_linears, (shard, dim, seq,
                                                           tuple(k for k, _w, _b in kinds), *params))
        fused.meta = dict(first.meta)
        fused.meta["val"] = tuple(u.meta.get("val") for u in users)
        items = []
        with graph.inserting_before(first):
            for i, u in enumerate(users):
                items.append(graph.call_function(operator.getitem, (fused, i)))
                items[-1].meta = dict(u.meta)
        for u, item in zip(users, items):
            u.replace_all_uses_with(item)
            graph.erase_node(u)
        order = _position(graph)
    if not ag.users:
        graph.erase_node(ag)


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def enter_region(graph: fx.Graph, x: fx.Node, place, seq, region: set, tp: int,
                 blocks=()) -> list[fx.Node]:
    """``x`` (replicated on every tp rank) enters the sequence-parallel region as this rank's
    slice for the region's readers. A vocab-parallel embedding (Partial output) would
    enter through a reduce-scatter here instead of an all-reduce and this slice. A
    parameter is sliced in each block (of ``blocks``) that reads it, before its first
    reader there: one slice after the read would send a block's weight from the stage that
    holds the first block (x-transformers' position MLP, a module every block calls).
    Returns the slices."""
    readers = [u for u in x.users if u in region]
    if x.op != "get_attr":
        return [_slice(graph, x, None, readers, (*place, tp), seq)]
    # a reader outside every block (a module the block calls but does not own) runs in the
    # last block before it, as split_stages assigns it
    groups: dict = {}
    current, wanted = None, set(readers)
    for n in graph.nodes:
        current = (block_of(n, blocks) if n.op != "get_attr" else None) or current
        if n in wanted:
            groups.setdefault(current, []).append(n)
    order = _position(graph)
    return [_slice(graph, x, min(group, key=order), group, (*place, tp), seq)
            for group in groups.values()]


def _slice(graph, x, first, readers, shard, seq) -> fx.Node:
    """The slice of ``x`` that ``readers`` read: after ``x``, or before ``first`` in its
    module."""
    with graph.inserting_after(x) if first is None else graph.inserting_before(first):
        s = graph.call_function(split_to_sequence_parallel_region, (x, shard[0], seq))
    s.meta = dict(x.meta) if first is None else _reader_meta(x, first)
    s.meta[SEQUENCE_SHARD] = shard
    for u in readers:
        u.replace_input_with(x, s)
    return s


def _exit(graph, x, place, seq, readers) -> None:
    """Gather ``x`` before its first reader outside, in that reader's module (a pipeline
    boundary between them then carries the shard)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(readers, key=lambda u: order[u])
    with graph.inserting_before(first):
        g = graph.call_function(gather_from_sequence_parallel_region, (x, place[0], seq))
    g.meta = _reader_meta(x, first)
    g.meta.pop(SEQUENCE_SHARD, None)
    for u in readers:
        u.replace_input_with(x, g)


def _reader_meta(x: fx.Node, reader: fx.Node) -> dict:
    """``x``'s value metadata in ``reader``'s module: an inserted node belongs to the block
    (and pipeline stage) of the node that reads it."""
    meta = dict(x.meta)
    for key in ("nn_module_stack", "stack_trace"):
        if key in reader.meta:
            meta[key] = reader.meta[key]
        else:
            meta.pop(key, None)
    return meta


def _global_seq(graph, by_name, source):
    """A node holding the global sequence length (``sym_size`` of the input it was read
    from, after the placeholders), or the int of a static one."""
    if isinstance(source, int):
        return source
    name, dim = source
    ph = by_name[name]
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        n = graph.call_function(aten.sym_size.int, (ph, dim))
    n.meta["val"] = ph.meta["val"].shape[dim]
    return n


def _local_seq(graph, seq, tp):
    if isinstance(seq, int):
        return sequence_shard_length(seq, tp)  # static: checked now
    with graph.inserting_after(seq):
        n = graph.call_function(sequence_shard_length, (seq, tp))
    n.meta["val"] = seq.meta["val"] // tp
    return n


def _sizes_from_region(graph, region, seq) -> None:
    """A ``sym_size`` read of a region value's sequence dim gives the local length: the
    graph's readers meant the global one."""
    for n in list(graph.nodes):
        if n.target is aten.sym_size.int and n.args[0] in region and n is not seq:
            dim, flat, _tp = n.args[0].meta[SEQUENCE_SHARD]
            if n.args[1] == dim and not flat:
                for u in list(n.users):
                    u.args = fx.node.map_arg(u.args, lambda a: seq if a is n else a)
                    u.kwargs = fx.node.map_arg(u.kwargs, lambda a: seq if a is n else a)
                graph.erase_node(n)
