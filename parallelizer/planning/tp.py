"""Tensor-parallel planner: which linears are column_parallel and which row_parallel.

Reads the graph, never changes it (the tensor_parallel pass applies the decision).
Seed: a linear whose output reaches another linear's input through ops that keep a shard
(elementwise, gating, view, attention over heads) is the column half of a Megatron pair and
the reached linear its row half (Megatron-LM §3: MLP A|B column then row; attention q/k/v
column over heads, output projection row). Then sharding propagation checks the whole
graph; a pair group whose shard reaches an op with no rule is kept replicated, with the
reason in the report. Divisibility of every sharded size by tp is checked last; then the
gradients' placements are derived (:mod:`.gradients`): f edges beyond the column linears'
inputs, and the parameters whose gradients are summed over tp. The walks are in
:mod:`.tp_seeds`; where no sharded rule takes a value, propagation redistributes it
(analysis/sharding/redistribute.py) before a group is kept replicated.

Linears are ``aten.linear`` (nn.Linear, weight (out, in)) and ``aten.addmm`` on a parameter
(GPT-2's Conv1D, weight (in, out)): column_parallel shards the output-features dim of the
weight, row_parallel the input-features dim, whichever that is. Propagation also decides
each column weight's layout (:mod:`parallelizer.plan.layouts`): ``fused`` when its output is
split into parts (q|k|v), ``replicated_heads`` for GQA kv heads when tp exceeds them.
"""
from __future__ import annotations

import math

import torch.fx as fx

from ..plan.decisions import TPDecision, VocabDecision
from ..errors import PlanError
from ..analysis.linears import linear_sites, weight_masks
from ..analysis.sharding.placements import Shard
from .gradients import plan_gradients
from .redistributions import example_sizes, redistributions, report_lines
from .tp_candidates import (indivisible, merged_layout, merged_whole, one_head_whole,
                            pairs_settled, replicated_plan)
from .tp_chains import chains_whole
from .tp_matrices import custom_op_weights, op_text, other_matrices
from .tp_sizes import check_divisible, divisible
from .tp_seeds import (COMPUTED_WEIGHTS, conditioning_ops, first_end, linears_feeding,
                       nearest_linears)



def plan_tp(graph: fx.Graph, tp: int, allow_replicated: bool = False,
            expert_dims: dict | None = None, vocab_next: bool = False) -> TPDecision:
    """Decide the Megatron column/row pairs for ``graph`` at tp degree ``tp``.
    ``expert_dims``: the parameters the experts planner splits over tp (planning/experts.py:
    fqn -> dim), so tp shards something even when no pair is found here, and those are not
    reported replicated. ``vocab_next``: the caller plans vocab_parallel next and calls
    :func:`check_sharded`, so a plan sharding no linear is left to it (an embedding and LM
    head sharded over the vocabulary are a real saving: zoo 24 F3's LSTM LM).

    Raises:
        PlanError: tp does not divide a sharded size (heads, kv heads, features); the
            message names ``mesh.tp``, the module and the tp degrees that would work. Or
            tp > 1 shards nothing, no expert is split and ``allow_replicated`` (the spec's
            ``tensor_parallel.allow_replicated``) is false: names the first op that stopped it
            (with ``vocab_next``, :func:`check_sharded` raises it, unless the vocabulary is
            sharded).
    """
    decision = TPDecision(tp=tp)
    sites = linear_sites(graph)
    decision.linears = list(dict.fromkeys(site.weight for site in sites))
    for site in sites:
        if site.bias:
            decision.biases[site.bias] = site.weight
    if tp == 1:
        return decision
    first = chains_whole(graph, sites, tp, decision, pairs_settled(graph, sites, tp, decision))
    pairs, column, row, prop = first
    if not divisible(prop, tp):
        # a group needs a size tp does not divide (3 heads at tp 2, an FFN of 37 at tp 2):
        # plan as without its redistributions (that group then replicated, its conflict
        # names why), with the linears behind heads tp is a multiple of kept whole, or with
        # the groups behind every such size kept whole, whichever shards most; else the
        # error below names the size and the tp degrees that divide it
        pairs, column, row, prop = indivisible(graph, sites, tp, decision, first,
                                               bool(expert_dims))
    if allow_replicated and not divisible(prop, tp):  # run replicated, the size named
        pairs, column, row, prop = replicated_plan(graph, tp, decision, prop)
    check_divisible(prop, tp)
    pairs, column, row, prop = one_head_whole(graph, tp, decision, (pairs, column, row, prop))
    pairs, column, row, prop = merged_whole(graph, sites, tp, decision, (pairs, column, row, prop))
    layouts = prop.found_layouts()
    decision.column, decision.row, decision.rewrites = column, row, prop.rewrites
    kv = frozenset(prop.kv_weights)
    decision.divides = math.gcd(*[c.size for c in prop.constraints if not c.replicable(kv)])
    decision.size_copies = dict(prop.size_copies)
    by_name = {n.name: n for n in graph.nodes}
    decision.placements = dict(prop.placements)
    for site in sites:
        w = site.weight
        if w in column or w in row:
            decision.dims[w] = site.out_dim if w in column else site.in_dim
        if w in column and site.bias:
            decision.dims[site.bias] = 0
        if w in column and w in layouts:  # a merged parameter's in its own dim's units
            decision.layouts[w] = merged_layout(site, layouts[w])
        if w in row and w in layouts:  # its input features', heads inner (strided.py)
            decision.layouts[w] = layouts[w]
        if w in column and site.bias in layouts:  # its weight's, or its pieces' side by side
            decision.layouts[site.bias] = layouts[site.bias]
        for mask in weight_masks(site) if w in column or w in row else ():
            decision.masks[mask], decision.dims[mask] = w, decision.dims[w]
            if w in decision.layouts:
                decision.layouts[mask] = decision.layouts[w]
    for fqn, (d, _groups) in sorted(prop.per_head.items()):
        decision.per_head[fqn] = decision.dims[fqn] = d
        decision.report.append(f"sharded with the heads or channels it meets (dim {d}): {fqn}")
    for name, (d, _groups) in sorted(prop.narrow.items()):
        decision.narrows[name] = d
        decision.report.append(f"cut to each rank's heads (dim {d}): {op_text(by_name[name])} "
                               f"(a replicated per-head value merged with the batch)")
    decision.redistributions = redistributions(graph, prop, tp)
    decision.report += report_lines(decision.redistributions)
    decision.report += summed_rows(sites, row)
    for w, layout in sorted(decision.layouts.items()):
        if w in column or w in row:
            decision.report.append(f"layout {layout.text()}: {w}")
    paired = {w for c, rows in pairs.items() if rows for w in {c} | rows}
    is_linear = {s.node: s for s in sites}
    for site in sites:
        kept = decision.replicated.get(site.weight, ())  # tp_candidates._whole_indivisible
        if kept:
            decision.report += [line for line in kept if line not in decision.report]
        elif site.weight not in paired:
            why = _why_unpaired(site, is_linear, column, row, prop)
            line = f"replicated linear: {site.weight} ({why}; {op_text(site.node)})"
            decision.replicated.setdefault(site.weight, []).append(line)
            decision.report.append(line)
    decision.report += custom_op_weights(graph)
    decision.other_replicated = other_matrices(graph, decision, expert_dims or {})
    decision.report += list(decision.other_replicated.values())
    if not column and not row:
        why = _unsharded_why(decision, first_end(sites))
        if vocab_next and not expert_dims:
            decision.unsharded = why
        else:
            _nothing_sharded(decision, tp, allow_replicated, bool(expert_dims), why)
    else:  # the backward's f edges and Partial gradients, derived (planning/gradients.py)
        plan_gradients(graph, decision)
    return decision


def summed_rows(sites: list, row: set) -> list[str]:
    """The report line on what the row_parallel linears sum over tp every step (Megatron's
    g), the largest output named: talking-heads attention's head-mixing product, row
    parallel over the heads, sums the (B, T, T, H) scores, which the report left unsaid
    (zoo 21). Elements on the example batch; [] without rows."""
    sizes = []
    for s in sites:
        dims = example_sizes(s.bias_add or s.node) if s.weight in row else None
        if dims is not None:
            sizes.append((math.prod(dims), dims, s))
    if not sizes:
        return []
    n, dims, site = max(sizes, key=lambda t: t[0])
    return [f"summed over tp every step (Megatron's g): {len(sizes)} row_parallel output(s), "
            f"{sum(t[0] for t in sizes):,} elements on the example batch; the largest "
            f"{'x'.join(map(str, dims))} = {n:,}, of {site.weight} ({op_text(site.node)})"]


def _why_unpaired(site, is_linear: dict, column: set, row: set, prop) -> str:
    """Why a linear no pair took stays whole: it only feeds column linears (LoRA's ``A``,
    whose small rank dim a cut would pay an all-reduce for), reads a row linear's Partial
    output (LoRA's ``B`` after a row-parallel ``A``), conditions every position (adaLN), is
    a product within each head of a column's output (its input sharded along a dim it does
    not contract, in ``prop``'s placements), or no pair was found. ``is_linear``: node ->
    its linear site."""
    px = prop.placements.get(site.x.name) if isinstance(site.x, fx.Node) else None
    if isinstance(px, Shard):  # linear_rule._uncontracted: a product within each head
        by = ", ".join(sorted(prop.groups.get(site.x.name, ()))) or "a sharded value"
        return (f"applied whole to each rank's shard of its input along dim {px.dim}, a dim "
                f"it does not contract (the sharded output of {by}); its gradient is summed "
                f"over tp")
    fed = nearest_linears(site.node, is_linear)
    if fed and fed <= column:
        return f"feeds only column_parallel {', '.join(sorted(fed))}, which take its output whole"
    read = linears_feeding(site.x, is_linear) if isinstance(site.x, fx.Node) else set()
    if read and read <= row:
        return (f"reads the Partial output of row_parallel {', '.join(sorted(read))}, applied "
                f"before its all-reduce")
    conditioning = conditioning_ops(site.node, is_linear)
    if conditioning:
        op = min(conditioning, key=lambda n: n.name)
        return (f"a per-sample conditioning vector (adaLN, FiLM): its output scales or shifts "
                f"every position at {op_text(op)}, so it pairs with no linear and its weight "
                f"stays whole (its matmul is one row per sample)")
    return "no column/row pair found"


def check_sharded(decision: TPDecision, vocab: VocabDecision, allow_replicated: bool) -> None:
    """After :func:`plan_tp` with ``vocab_next``: a plan sharding no linear is a warning when
    vocab_parallel shards the embedding or LM head (each rank holds 1/tp of the vocabulary),
    else :func:`_nothing_sharded`'s error or warning.

    Raises:
        PlanError: nothing is sharded and ``allow_replicated`` is false (names mesh.tp, the
            first op that stopped tp and the spec keys that fix it).
    """
    if not decision.unsharded:
        return
    if not vocab.vocab:
        _nothing_sharded(decision, decision.tp, allow_replicated, why=decision.unsharded)
        return
    sharded = sorted(vocab.tables | vocab.heads)
    decision.warnings.append(
        f"mesh.tp={decision.tp} shards only the vocabulary ({', '.join(sharded)}, Shard(0)): "
        f"no other weight matrix could be sharded ({decision.unsharded}), so the rest of the "
        f"model is replicated on every tp rank; see report.md")


def _unsharded_why(decision: TPDecision, ends: str = "") -> str:
    """Why no linear is sharded: the first op that stopped tp, the pair not found, or the
    model's matrices no rule takes."""
    why = (f"the first op that stopped it: {decision.blockers[0]}" if decision.blockers else
           f"no column/row pair was found: {ends}" if ends else
           f"no linear layer feeds another (a matmul with a 2-D parameter operand whose output "
           f"reaches a second one; {COMPUTED_WEIGHTS})")
    other = sorted(decision.other_replicated.values(), key=lambda line: ", flat, read by " not in line)
    if other and not decision.blockers:  # the matrices the model does use (stored flat, convs)
        why += f"; {other[0].removeprefix('replicated: ')}"
    return why


def _nothing_sharded(decision: TPDecision, tp: int, allow_replicated: bool,
                     experts_split: bool = False, why: str = "") -> None:
    """tp > 1 with nothing sharded: every rank would hold the whole model and only add
    all-reduces. An error unless the spec allows it (then a warning), or a warning that only
    the experts are split."""
    if experts_split:
        if any(w.startswith(f"mesh.tp={tp} keeps") for w in decision.warnings):
            return  # tp_candidates._kept_warning said which linears and why
        decision.warnings.append(
            f"mesh.tp={tp} splits only the experts (along their FFN dim): no other weight "
            f"matrix could be sharded ({why}), so attention and the rest are replicated on "
            f"every tp rank; see report.md")
        return
    if not allow_replicated:
        raise PlanError(
            f"mesh.tp={tp} but no weight matrix could be sharded; {why}. Every rank would "
            f"hold the whole model; set mesh.tp=1, or tensor_parallel.allow_replicated=true to "
            f"run replicated anyway (report.md lists every matrix kept replicated)")
    decision.warnings.append(
        f"mesh.tp={tp} but no weight matrix could be sharded ({why}): every rank holds the "
        f"whole model (tensor_parallel.allow_replicated); see report.md")
