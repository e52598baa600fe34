"""The expert_parallel pass: each planned mixture-of-experts layer dispatches its rows to
their experts' ranks and combines them back (plan: :class:`EPDecision`; runtime:
:mod:`parallelizer.runtime.expert_parallel`).

Around the layer's expert region (its grouped matmuls and the row-wise ops between them,
planning/experts.py) the pass inserts ``route = ep_route(offs, E)`` and
``ep_local_offsets(route)`` before the first grouped matmul, ``ep_dispatch(x, route)`` for
each row tensor entering the region and ``ep_combine(y, route)`` after each row tensor
leaving it. The region's ops then read the dispatched rows, the local offsets and the
rank's rows of the stacked weights (the emitted parameter is (E/ep, ...)); nothing else of
the model changes: the router, the sort by expert, the weighting and the top-k sum run as
the model wrote them, on the rank's own tokens.

A layer whose FFN dim the plan splits over tp (``layer["tp"]``, planning/experts.py) also
gets Megatron's operators around the same region (Shoeybi et al. 2019, §3): ``f``
(``copy_to_tp_region``) on each row tensor entering it (the rows are replicated over tp
and feed every rank's block of the features, so their gradient is summed over tp) and
``g`` (``reduce_from_tp_region``) on each leaving it (the row-parallel down projection's
Partial sums), before the combine; explicit FFN sizes inside the region become local ones.
With ep, each tp rank dispatches its (tp-replicated) rows over its own ep group: ``x -> f
-> ep_dispatch -> region -> g -> ep_combine``.
"""
from __future__ import annotations

import torch.fx as fx

from ..plan.decisions import EPDecision
from ..runtime.expert_parallel import ep_combine, ep_dispatch, ep_local_offsets, ep_route
from ..runtime.tp import copy_to_tp_region, reduce_from_tp_region
from .tensor_parallel import rewrite_constants


def apply_expert_parallel(gm: fx.GraphModule, decision: EPDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if not decision.layers or (decision.ep == 1 and not any(l["tp"] for l in decision.layers)):
        return False
    graph = gm.graph
    rewrite_constants(graph, decision.rewrites)
    for layer in decision.layers:
        _rewrite(graph, layer, {n.name: n for n in graph.nodes}, decision.ep > 1)
    graph.lint()
    gm.recompile()
    return True


def _rewrite(graph: fx.Graph, layer: dict, by_name: dict, ep: bool) -> None:
    region = [by_name[n] for n in layer["region"]]
    members = set(region)
    route = _route(graph, layer, by_name) if ep else None
    for name in layer["inputs"]:
        x = by_name[name]
        users = [u for u in region if x in u.all_input_nodes]
        sent = x
        with graph.inserting_before(users[0]):
            if layer["tp"] and name not in layer.get("split_rows", ()):
                # f: the replicated rows' gradient is summed over tp (a bias's rows arrive
                # split with the features: each rank's gradient is its own block)
                sent = _call(graph, copy_to_tp_region, (sent,), x)
            if ep:
                sent = _call(graph, ep_dispatch, (sent, route), x)
        for u in users:
            u.replace_input_with(x, sent)
    for name in layer["outputs"]:
        y = by_name[name]
        last, made = y, set()
        for fn, wanted in ((reduce_from_tp_region, layer["tp"]), (ep_combine, ep)):
            if wanted:  # g: the row-parallel projection's Partial sums, before the combine
                with graph.inserting_after(last):
                    last = _call(graph, fn, (last,) if fn is reduce_from_tp_region else
                                 (last, route), y)
                made.add(last)
        y.replace_all_uses_with(last, delete_user_cb=lambda u: u not in made and u not in members)


def _route(graph: fx.Graph, layer: dict, by_name: dict) -> fx.Node:
    offs, first = by_name[layer["offsets"]], by_name[layer["matmuls"][0]]
    with graph.inserting_before(first):
        route = graph.call_function(ep_route, (offs, layer["experts"]))
        local_offs = graph.call_function(ep_local_offsets, (route,))
    local_offs.meta = dict(offs.meta)
    for mm in (by_name[m] for m in layer["matmuls"]):
        mm.replace_input_with(offs, local_offs)
    return route


def _call(graph: fx.Graph, fn, args: tuple, like: fx.Node) -> fx.Node:
    node = graph.call_function(fn, args)
    node.meta = dict(like.meta)
    return node
