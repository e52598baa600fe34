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
"""
from __future__ import annotations

import torch.fx as fx

from ..plan.decisions import EPDecision
from ..runtime.expert_parallel import ep_combine, ep_dispatch, ep_local_offsets, ep_route


def apply_expert_parallel(gm: fx.GraphModule, decision: EPDecision) -> bool:
    """Rewrite ``gm`` in place; returns whether anything changed."""
    if decision.ep == 1 or not decision.layers:
        return False
    graph = gm.graph
    for layer in decision.layers:
        _rewrite(graph, layer, {n.name: n for n in graph.nodes})
    graph.lint()
    gm.recompile()
    return True


def _rewrite(graph: fx.Graph, layer: dict, by_name: dict) -> None:
    region = [by_name[n] for n in layer["region"]]
    members = set(region)
    offs, first = by_name[layer["offsets"]], by_name[layer["matmuls"][0]]
    with graph.inserting_before(first):
        route = graph.call_function(ep_route, (offs, layer["experts"]))
        local_offs = graph.call_function(ep_local_offsets, (route,))
    local_offs.meta = dict(offs.meta)
    for mm in (by_name[m] for m in layer["matmuls"]):
        mm.replace_input_with(offs, local_offs)
    for name in layer["inputs"]:
        x = by_name[name]
        users = [u for u in region if x in u.all_input_nodes]
        with graph.inserting_before(users[0]):
            sent = graph.call_function(ep_dispatch, (x, route))
        sent.meta = dict(x.meta)
        for u in users:
            u.replace_input_with(x, sent)
    for name in layer["outputs"]:
        y = by_name[name]
        with graph.inserting_after(y):
            back = graph.call_function(ep_combine, (y, route))
        back.meta = dict(y.meta)
        y.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b and u not in members)
