"""Plan the whole-batch denominators of token means (analysis/token_mean.py): which quotients
take them and the code that counts them on a chunk of the inputs before the step.

The counter is the part of the captured graph that derives each count from the model inputs
(the labels' shift and padding, a mask), copied node for node, so it counts exactly what the
loss divides by; its source is data in the plan (``ParallelPlan.token_means``), run by
runtime/token_mean.py on every chunk of the step.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import aten
from ..analysis.token_mean import TokenMeanSite, only_sites, token_mean_sites
from ..plan.decisions import TokenMeanDecision

# the names fx's code generation may reference that the runtime defines (runtime/token_mean.py)
COUNTER_GLOBALS = {"torch", "device", "inf", "nan", "NoneType", "fx_pytree", "pytree"}


def plan_token_mean(graph: fx.Graph, input_names) -> TokenMeanDecision:
    """The token-mean sites of ``graph`` (as captured) and their counter; an empty decision
    when there are none or the counter cannot be written as plain code."""
    sites = token_mean_sites(graph, input_names)
    if not sites:
        return TokenMeanDecision()
    counter = counter_source(graph, sites, input_names)
    if counter is None:
        return TokenMeanDecision()
    return TokenMeanDecision(tuple(s._asdict() for s in sites), counter, only_sites(graph, sites))


def counter_source(graph: fx.Graph, sites: list[TokenMeanSite], input_names) -> str | None:
    """Source of ``forward(self, *inputs)`` returning each site's count: a loss's non-ignored
    targets (``(target != ignore_index).sum()``), a divisor as computed; None when fx's code
    for it needs a global the runtime does not define."""
    nodes = {n.name: n for n in graph.nodes}
    out = fx.Graph()
    env = {n: out.placeholder(n.name) for n in graph.nodes
           if n.op == "placeholder" and n.name in set(input_names)}
    order = [n for n in (nodes.get(name) for name in input_names) if n is not None]
    if len(order) != len(input_names):  # the counter takes every input, in the plan's order
        return None
    counts = []
    for site in sites:
        value = _copy(out, env, nodes[site.count])
        if site.kind == "loss":
            value = out.call_function(aten.sum.default,
                                      (out.call_function(aten.ne.Scalar, (value, site.ignore_index)),))
        counts.append(value)
    out.output(tuple(counts))
    code = out.python_code(root_module="self")
    if not set(code.globals) <= COUNTER_GLOBALS:
        return None
    return code.src


def _copy(out: fx.Graph, env: dict, node: fx.Node) -> fx.Node:
    """``node`` and its ancestors (model inputs and ops on them) copied into ``out``."""
    todo = [node]
    while todo:
        n = todo[-1]
        missing = [a for a in n.all_input_nodes if a not in env]
        if missing:
            todo += missing
            continue
        todo.pop()
        if n not in env:
            env[n] = out.node_copy(n, lambda a: env[a])
    return env[node]


def token_mean_note(decision: TokenMeanDecision) -> str:
    """The compile's line on the token means ('' for none)."""
    if not decision.sites:
        return ""
    what = [f"{'the loss' if s['kind'] == 'loss' else 'the division'}"
            f"{' at ' + s['line'] if s['line'] else ''} ("
            + (f"targets other than {s['ignore_index']}" if s["kind"] == "loss" else "its divisor")
            + ")" for s in decision.sites]
    whole = ("the loss and its gradients are the whole batch's" if decision.exact else
             "that part of the loss is the whole batch's, its other terms still average each "
             "chunk's own (a warning follows where that differs)")
    return (f"token mean: {', '.join(what)} divided by the count over the whole step's batch "
            f"(summed over dp ranks, microbatches and gradient accumulation before the step), "
            f"not each chunk's: {whole} (Hugging Face's num_items_in_batch)")
