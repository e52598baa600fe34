"""split_stages pass: one graph per pipeline stage.

Every node goes to the stage of the block it belongs to (by ``nn_module_stack``); nodes
outside blocks go with the most recent block before them (stage 0 before the first block,
the last stage after the last, which may then hold no block). Stage ``s`` takes as inputs every tensor defined before it
and used at or after it, in graph order, except those it recomputes (``recompute``: values
of buffers, constants and sizes only, such as Llama's causal mask and rotary cos/sin: each
stage that uses one copies its producers), and returns what stage ``s+1`` takes, so values
needed further down (MiniLM's extended attention mask) pass through the stages in between;
that is what ``torch.distributed.pipelining.PipelineStage`` needs (stage s's outputs are
stage s+1's inputs); an output not known to be contiguous is sent as ``contiguous(x)``. Parameters are read with get_attr in every stage that uses them
(tied weights appear in two stages), and non-tensor values (SymInt sizes) are recomputed
from a local tensor carrying the same symbol, since only tensors cross stages; a tensor
carrying a size that nothing else sent carries is sent as well (``_size_carriers``). A
received tensor the stage writes into in place, or through a view, is read as a clone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..plan.decisions import PipelineDecision
from ..analysis.partition import GraphPartition
from ..analysis.graph_facts import aten, expr, is_tensor
from ..analysis.sharding.redistribute import written_through


@dataclass
class StageGraph:
    index: int
    graph: fx.Graph
    inputs: list = field(default_factory=list)    # names of boundary inputs
    outputs: list = field(default_factory=list)   # names of boundary outputs
    targets: list = field(default_factory=list)   # get_attr targets read here


def assign_stages(partition: GraphPartition, decision: PipelineDecision) -> dict:
    """node -> stage index for every placeholder and call_function node: the stage of its
    cost-model unit, or of its part in a block cut across stages
    (``PipelineDecision.stage_of_unit``), so the split is the one the partitioner costed;
    what follows the last block goes to the last stage."""
    return {n: decision.stage_of_unit(u, partition.child_of.get(n))
            for n, u in partition.unit_of.items()}


def split_stages(gm: fx.GraphModule, decision: PipelineDecision, pp: int) -> list[StageGraph]:
    graph = gm.graph
    # the rewritten graph's own partition: the passes inserted nodes (f/g, untied reads)
    partition = GraphPartition.of(graph, decision.blocks)
    stage_of = assign_stages(partition, decision)
    recompute = partition.recompute
    boundary = [_boundary(graph, stage_of, s, recompute) for s in range(pp)]
    out = []
    for s in range(pp):
        outputs = boundary[s + 1] if s + 1 < pp else None
        out.append(_extract(graph, stage_of, s, boundary[s], outputs, recompute))
    return out


def _boundary(graph, stage_of, s, recompute):
    """Tensors defined before stage s and used at or after it, less those stage s
    recomputes (stage 0: model inputs)."""
    if s == 0:
        return [n for n in graph.nodes if n.op == "placeholder"]
    out = []
    for n in graph.nodes:
        if n in stage_of and stage_of[n] < s and is_tensor(n):
            if any(u.op == "output" or stage_of.get(u, -1) >= s for u in n.users):
                out.append(n)
    sent = recompute.sent(out)
    return sent + [t for t in _size_carriers(graph, stage_of, s, sent) if t not in sent]


def _size_carriers(graph, stage_of, s, sent) -> list:
    """The tensors stage ``s`` must also receive for a size it uses that none of ``sent``
    has as a dim: a last stage padding its output back to the input's ``n`` samples
    receives only frames (``n // 4``), so the input itself is sent along."""
    carried = {expr(d) for t in sent for d in t.meta["val"].shape}
    out, seen = [], set()

    def need(n):
        val = n.meta.get("val")
        if n in seen or not isinstance(val, torch.SymInt) or expr(val) in carried:
            return
        seen.add(n)
        if n.target is aten.sym_size.int and is_tensor(n.args[0]):
            if n.args[0] not in out:
                out.append(n.args[0])
            return
        for a in n.all_input_nodes:
            need(a)

    for n in graph.nodes:
        if n in stage_of and stage_of[n] < s and not is_tensor(n) and n.op != "placeholder":
            if any(stage_of.get(u, -1) >= s for u in n.users):
                need(n)
    return out


def _extract(graph, stage_of, s, inputs, outputs, recompute) -> StageGraph:
    new = fx.Graph()
    env = {}
    mine = [n for n in graph.nodes if stage_of.get(n) == s and n.op != "placeholder"]
    for n in inputs:
        env[n] = new.placeholder(n.name)
        env[n].meta = dict(n.meta)
        # received from the stage before, n is a leaf that requires grad there
        # (torch.distributed.pipelining), which autograd lets no in-place op write into
        if s > 0 and written_through(n, set(mine)):
            env[n] = new.call_function(aten.clone.default, (env[n],))
            env[n].meta = dict(n.meta)
    targets = []

    def get(a):
        if a in env:
            return env[a]
        if a.op == "get_attr":
            env[a] = new.get_attr(a.target)
            env[a].meta = dict(a.meta)
            targets.append(a.target)
            return env[a]
        if not is_tensor(a) or a in recompute:
            env[a] = _rematerialize(new, a, env, get)
            return env[a]
        raise AssertionError(f"stage {s} needs {a.name} (stage {stage_of.get(a)}) but it is not a boundary input")

    # recomputed values first, at the stage's top level, not amid a block's nodes (where
    # split_blocks would outline them into the block)
    for n in mine:
        for a in n.all_input_nodes:
            if a in recompute and stage_of.get(a) != s:
                get(a)
    for n in mine:
        env[n] = new.node_copy(n, lambda a: get(a))
    if outputs is None:
        result = graph.output_node().args[0]
        new.output(tuple(get(a) if isinstance(a, fx.Node) else a for a in result))
    else:
        new.output(tuple(_contiguous(new, get(a)) for a in outputs))
    new.lint()
    return StageGraph(s, new, [n.name for n in inputs],
                      [n.name for n in outputs] if outputs else [], targets)


def _contiguous(new: fx.Graph, node: fx.Node) -> fx.Node:
    """``aten.contiguous(node)``: gloo and NCCL send only contiguous tensors (``isend``:
    "input tensor has to be contiguous"; T5's stage outputs are transposed views), and
    torch's PipelineStage sends stage outputs as they are. Even a value the graph records
    as contiguous: eager kernels may return a view where the fake ones do not (XLNet's
    ``dropout(pos_emb.expand(...), 0.0)`` is the expanded view itself). ``contiguous``
    returns its input when it already is; a non-tensor is returned as it is."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return node
    out = new.call_function(aten.contiguous.default, (node,))
    # at the stage's top level, so the block before keeps its emitted class
    out.meta = {k: x for k, x in node.meta.items() if k != "nn_module_stack"}
    out.meta["val"] = v.contiguous()
    return out


def _sequence_sharded(orig: fx.Node, local: fx.Node, dim: int) -> bool:
    shard = orig.meta.get("sequence_shard")
    return shard is not None and shard[0] == dim


def _rematerialize(new: fx.Graph, node: fx.Node, env: dict, get) -> fx.Node:
    """Recompute a non-tensor value (a SymInt size) or a recomputable tensor (``recompute``)
    from what this stage has, copying its producers. A size is read off a tensor of the
    stage that carries it, when one does: Wav2Vec2's frame count ``s // 10 - 1``, computed
    from the audio length ``s`` of the model's input, is a dim of every later stage's
    hidden states, while ``s`` itself is no dim of anything a later stage receives."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt) or node.target is aten.sym_size.int:
        carried = _size_from_stage(new, node, env)
        if carried is not None:
            return carried
        if node.target is aten.sym_size.int:
            raise AssertionError(f"no tensor in this stage carries size {expr(val)} for "
                                 f"{node.name}")
    copy = new.node_copy(node, lambda a: get(a))
    copy.meta = _prologue(node.meta)
    return copy


def _prologue(meta: dict) -> dict:
    """``meta`` of a value a stage recomputes at its top level, without the module it was
    computed in: a size an earlier block computed (TimeSformer's ``b * n`` inside its first
    layer, read by every layer after it) would place the copy in that block, which this
    stage does not hold (split_check: "blocks ('layers.0', 'layers.1') vs planned
    ('layers.1',)")."""
    return {k: v for k, v in meta.items() if k not in _MODULE_KEYS}


_MODULE_KEYS = ("nn_module_stack", "fwd_nn_module_stack")


def _size_from_stage(new: fx.Graph, node: fx.Node, env: dict) -> Optional[fx.Node]:
    """``sym_size(t, i)`` of a tensor ``t`` of this stage whose dim ``i`` is ``node``'s
    value, else None."""
    want = expr(node.meta["val"])
    found = [(orig, local, i) for orig, local in env.items()
             if is_tensor(orig) and local.op != "get_attr"
             for i, size in enumerate(orig.meta["val"].shape) if expr(size) == want]
    # a sequence shard (passes/sequence_parallel.py) holds 1/tp of its recorded size
    whole = [f for f in found if not _sequence_sharded(*f)]
    if not found:
        return None
    orig, local, i = (whole or found)[0]
    n = new.call_function(aten.sym_size.int, (local, i))
    n.meta = _prologue(node.meta)
    if not whole:
        n.meta = {k: v for k, v in n.meta.items() if k != "val"}
        n = new.call_function(operator.mul, (n, orig.meta["sequence_shard"][2]))
        n.meta = _prologue(node.meta)
    return n
