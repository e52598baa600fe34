"""vocab_parallel pass: apply a VocabDecision (planning/vocab.py) to the graph (Megatron-LM §3).

- ``aten.embedding(W, ids, padding_idx)`` of a vocabulary table becomes
  ``reduce_from_tp_region(vocab.vocab_parallel_lookup(W, ids, padding_idx))`` (local lookup,
  then Megatron's ``g``, tagged as the tp pass tags its own: sequence parallelism turns it
  into a reduce-scatter, Korthikanti et al. 2022 §4.2.2).
- an LM head ``aten.linear(x, W)`` becomes ``linear(copy_to_tp_region(x), W)`` (Megatron ``f``,
  tagged likewise: the gradient of x is summed over tp, or under sequence parallelism f is
  an all-gather fused with the head) with logits ``Shard(-1)``; the model outputs listed in
  ``outputs`` keep them sharded (run time hands them to loss_fn under loss_parallel),
  every other use reads ``vocab.gather_from_tp_region(logits, vocabulary)``; ops that keep
  the logits column for column (``analysis.logits.logits_region``: casts, a scalar
  scale or softcap) run on the shard first.
- an ``aten.cross_entropy_loss`` over those logits (``losses``: Hugging Face's in-graph
  loss) becomes ``vocab.vocab_parallel_cross_entropy`` on the shards.
"""
from __future__ import annotations

import torch.fx as fx

from ..plan.decisions import TP_OPERATOR, VocabDecision
from ..runtime.tp import copy_to_tp_region, reduce_from_tp_region
from ..runtime.vocab import gather_from_tp_region, vocab_parallel_lookup
from ..runtime.vocab_loss import vocab_parallel_cross_entropy
from ..analysis.graph_facts import aten
from ..analysis.logits import logits_region


def apply_vocab_parallel(gm: fx.GraphModule, decision: VocabDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if not decision.vocab:
        return False
    graph = gm.graph
    _rewrite_cross_entropies(graph, decision.losses)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default and node.args[0].target in decision.vocab:
            _shard_embedding(graph, node)
        elif node.target is aten.linear.default and node.args[1].target in decision.heads:
            _shard_head(graph, node, decision)
    graph.lint()
    gm.recompile()
    return True


def _shard_embedding(graph: fx.Graph, node: fx.Node) -> None:
    pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    node.target, node.kwargs = vocab_parallel_lookup, {}
    node.args = (*node.args[:2], pad)
    with graph.inserting_after(node):
        g = graph.call_function(reduce_from_tp_region, (node,))
    g.meta = {**node.meta, TP_OPERATOR: "g"}
    node.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g)


def _shard_head(graph: fx.Graph, head: fx.Node, decision: VocabDecision) -> None:
    vocab = decision.vocab[head.args[1].target]
    x = head.args[0]
    with graph.inserting_before(head):
        f = graph.call_function(copy_to_tp_region, (x,))
    f.meta = {**x.meta, TP_OPERATOR: "f"}
    head.replace_input_with(x, f)
    out = graph.output_node()
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else None
    region = logits_region(head)
    for node in region:  # sharded logits: every use outside the region reads them gathered
        users = [u for u in node.users if u not in region and u.op != "output"
                 and u.target is not vocab_parallel_cross_entropy]  # reads the shards
        kept = {i for i in decision.outputs} if flat is not None else set()
        to_output = [i for i, a in enumerate(flat or [out.args[0]]) if a is node and i not in kept]
        if not users and not to_output:
            continue
        with graph.inserting_after(node):
            whole = graph.call_function(gather_from_tp_region, (node, vocab))
            whole.meta = dict(node.meta)
        for u in users:
            u.replace_input_with(node, whole)
        if to_output and flat is None:
            out.args = (whole,)
        elif to_output:
            out.args = (type(flat)(whole if i in to_output else a for i, a in enumerate(flat)),)
            flat = out.args[0]


def _rewrite_cross_entropies(graph: fx.Graph, losses: dict) -> None:
    """``cross_entropy_loss(view(logits, [-1, V]), t, None, reduction, ignore_index)`` ->
    ``vocab_parallel_cross_entropy(logits, t, V, reduction, ignore_index)`` on the shards."""
    for node in [n for n in graph.nodes if n.name in losses]:
        args = list(node.args) + [None, 1, -100, 0.0][len(node.args) - 2:]
        logits, view = args[0], None
        if logits.target in (aten.view.default, aten.reshape.default):
            view, logits = logits, logits.args[0]
        node.target = vocab_parallel_cross_entropy
        node.args, node.kwargs = (logits, args[1], losses[node.name], args[3], args[4]), {}
        if view is not None and not view.users:
            graph.erase_node(view)
