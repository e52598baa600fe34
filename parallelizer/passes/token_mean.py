"""token_mean pass: apply a TokenMeanDecision (planning/token_mean.py).

A mean-reduced loss becomes its sum divided by ``runtime.token_mean.global_mean``'s
denominator, and a divide over a count becomes that call:

    cross_entropy_loss = aten.cross_entropy_loss(x, t, None, 2, -100)   # reduction sum
    count = aten.sum(aten.ne(t, -100))
    mean = token_mean.global_mean(cross_entropy_loss, count, 0)

``global_mean`` divides by this chunk's ``count`` (the unmodified model's mean, bit for bit)
unless the step runner has set the whole step's count (runtime/step.py); every user of the
loss reads ``mean``.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import aten
from ..plan.decisions import TokenMeanDecision
from ..runtime.token_mean import global_mean

_SUM = 2


def apply_token_mean(gm: fx.GraphModule, decision: TokenMeanDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if not decision.sites:
        return False
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    for index, site in enumerate(decision.sites):
        node = nodes[site["node"]]
        if site["kind"] == "loss":
            mean = _loss_mean(graph, node, site["ignore_index"], index)
        else:
            with graph.inserting_after(node):
                mean = graph.call_function(global_mean, (*node.args[:2], index))
            mean.meta.update(node.meta)
        node.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
        if site["kind"] == "div":
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return True


def _loss_mean(graph: fx.Graph, node: fx.Node, ignore_index: int, index: int) -> fx.Node:
    args = list(node.args) + [node.kwargs.get(k, d) for k, d in
                              (("weight", None), ("reduction", 1), ("ignore_index", -100),
                               ("label_smoothing", 0.0))][len(node.args) - 2:]
    if node.target is not aten.cross_entropy_loss.default:
        args = args[:5]
    args[3] = _SUM
    node.args, node.kwargs = tuple(args), {}
    target = args[1]
    with graph.inserting_after(node):
        ne = graph.call_function(aten.ne.Scalar, (target, ignore_index))
    with graph.inserting_after(ne):
        count = graph.call_function(aten.sum.default, (ne,))
    with graph.inserting_after(count):
        mean = graph.call_function(global_mean, (node, count, index))
    t = target.meta.get("val")  # fake tensors, for the analyses after this pass
    ne.meta.update(node.meta, val=None if t is None else t.ne(ignore_index))
    count.meta.update(node.meta, val=None if t is None else ne.meta["val"].sum())
    mean.meta.update(node.meta)
    return mean
