"""explicit_sizes pass: ``view_as`` / ``reshape_as`` / ``expand_as`` become ``view`` /
``reshape`` / ``expand`` with the other tensor's sizes spelled out.

Under tensor parallelism the program is written for local tensors: ``y.view_as(x)`` with a
head-sharded ``y`` and a replicated ``x`` reads ``x``'s whole hidden size, and the view
fails on every rank (the model of issue 23 that casts its weights in forward:
``y.transpose(1, 2).contiguous().view_as(x)`` before its output projection). As an explicit
size the hidden size is a shape constant like any other, which sharding propagation divides
by tp where the dim is sharded. Dynamic sizes read ``aten.sym_size.int`` of the other
tensor, as export writes them elsewhere. Runs before planning, on the captured graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.graph_facts import aten

_AS = {aten.view_as.default: aten.view.default, aten.reshape_as.default: aten.reshape.default,
       aten.expand_as.default: aten.expand.default}


def apply_explicit_sizes(gm: fx.GraphModule) -> bool:
    """Rewrite every ``*_as`` op of ``gm`` in place; whether there was one."""
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _AS or len(node.args) != 2:
            continue
        x, other = node.args
        val = other.meta.get("val") if isinstance(other, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        with graph.inserting_before(node):
            sizes = [_size(graph, other, i, s) for i, s in enumerate(val.shape)]
            new = graph.call_function(_AS[node.target], (x, sizes))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _size(graph: fx.Graph, other: fx.Node, i: int, s):
    if not isinstance(s, torch.SymInt):
        return int(s)
    n = graph.call_function(aten.sym_size.int, (other, i))
    n.meta["val"] = s
    return n
