"""Chains of linears within a block (:func:`parallelizer.planning.tp_seeds.chain_heads`): the
walks pair a chain's first two linears, a low-rank projection and its up-projection
(DeepSeek-V2/V3's multi-head latent attention: ``q_a -> norm -> q_b``, ``kv_a -> norm ->
kv_b``), so the rank dim is sharded, the up-projection's output is summed over tp and
attention is computed whole on every rank. The other plan keeps the chain's head whole: the
up-projection is the column over heads and the output projection its row, as Megatron-LM
shards MLA. Of the two, the one sending fewer bytes per step is taken, provided it keeps
sharded every weight the first shards other than the chain heads; a plan that shards more
parameter elements is taken even where it sends more (torch's ``nn.MultiheadAttention``
with kdim/vdim keys from a linear and ``need_weights``: the chain plan replicated q_proj,
out_proj and the attention for the heads' mean of the weights it saved sending, zoo 20 Z4).
Reads the graph, never changes it."""
from __future__ import annotations

import math

import torch.fx as fx

from ..analysis.graph_facts import aten, shape
from ..plan.decisions import TPDecision
from .redistributions import all_reduce_bytes, redistributions
from .tp_candidates import candidate
from .tp_seeds import chain_heads, seed_pairs
from .tp_sizes import divisible


def chains_whole(graph: fx.Graph, sites: list, tp: int, decision: TPDecision, chosen):
    """``chosen`` (pairs, column, row, propagation), or the plan with its chain heads kept
    whole when that shards every other weight ``chosen`` shards and either settles divisible
    where ``chosen`` does not, or is as divisible and shards more parameter elements
    (:func:`sharded_elements`) or sends fewer bytes per step (:func:`bytes_per_step`); its
    report then says so. Neither divisible (a chain head tp
    does not divide beside a feed-forward it does not divide either: recurrent-memory-
    transformer's 5-wide hyper-connection mixer and its GEGLU of 170 at tp 4, zoo 13 Z19), the
    cheaper one goes on to ``tp_candidates.indivisible``, which keeps the feed-forward whole:
    from ``chosen`` it kept the attention the mixer pairs with whole too, and nothing was
    left."""
    heads = chain_heads(sites, chosen[0]) & chosen[1]
    if not heads:
        return chosen
    scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
    found = candidate(graph, seed_pairs(sites, True, whole=heads), tp, scratch)
    fits, fitted = divisible(found[3], tp), divisible(chosen[3], tp)
    if fitted and not fits or not (chosen[1] | chosen[2]) - heads <= found[1] | found[2]:
        return chosen
    before, after = bytes_per_step(graph, sites, chosen, tp), bytes_per_step(graph, sites, found, tp)
    more = sharded_elements(graph, found) - sharded_elements(graph, chosen)
    if after >= before and more <= 0 and fits == fitted:
        return chosen
    decision.blockers, decision.report = scratch.blockers, scratch.report
    why = f"{more} more parameter elements sharded, " if more > 0 and after >= before else ""
    decision.report.append(
        f"kept whole, the head of a chain of linears: {', '.join(sorted(heads))} (the linears "
        f"it fed are columns instead: {why}{after} bytes per rank per step instead of "
        f"{before})")
    pairs = chosen[0]
    for w in sorted(heads):  # planning/tp.py reports these lines for each, not "no pair"
        fed = ", ".join(sorted(pairs[w] & found[1])) or "none"
        decision.replicated[w] = [
            f"replicated linear: {w} (the head of a chain of linears, kept whole: the linears "
            f"it feeds are column_parallel over heads ({fed}) and the chain's end their row, "
            f"{after} bytes per rank per step instead of {before} with it sharded)"]
    return found


def sharded_elements(graph: fx.Graph, found) -> int:
    """Elements of the parameters a settled plan shards column or row parallel: what the
    plan takes off each rank's memory and, with the ops on their shards, off its compute.
    A table an embedding reads is not counted: vocab_parallel shards a tied table whole
    either way (a chain ending in a tied LM head took it for a row and lost
    vocab_parallel)."""
    _pairs, column, row, _prop = found
    tables = {n.args[0].target for n in graph.nodes if n.op == "call_function"
              and n.target is aten.embedding.default and n.args[0].op == "get_attr"}
    return sum({n.target: math.prod(shape(n)) for n in graph.nodes
                if n.op == "get_attr" and n.target in (column | row) - tables}.values())


def bytes_per_step(graph: fx.Graph, sites: list, found, tp: int) -> int:
    """Bytes one rank sends per step (the example's shapes) for a settled plan: the row
    linears' outputs and the column linears' inputs all-reduced (Megatron's g forward, f
    backward; once per distinct input) and every redistribution."""
    _pairs, column, row, prop = found
    inputs = {s.x for s in sites if s.weight in column and isinstance(s.x, fx.Node)}
    outputs = {s.bias_add or s.node for s in sites if s.weight in row}
    return sum(all_reduce_bytes(n, tp) for n in inputs | outputs) + sum(
        r.bytes or 0 for r in redistributions(graph, prop, tp))
