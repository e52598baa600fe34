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

import torch
import torch.fx as fx

from ..plan.decisions import TPDecision
from ..plan.layouts import in_units
from ..errors import PlanError
from ..analysis.experts import find_expert_layers
from ..analysis.graph_facts import aten, linear_sites, shape, source_line
from ..analysis.sharding.propagate import Propagation, propagate
from .gradients import plan_gradients
from .redistributions import redistributions, report_lines
from .tp_seeds import seed_pairs



def plan_tp(graph: fx.Graph, tp: int, allow_replicated: bool = False,
            experts_split: bool = False) -> TPDecision:
    """Decide the Megatron column/row pairs for ``graph`` at tp degree ``tp``.
    ``experts_split``: the experts planner splits some expert FFNs over tp
    (planning/experts.py), so tp shards something even when no pair is found here.

    Raises:
        PlanError: tp does not divide a sharded size (heads, kv heads, features); the
            message names ``mesh.tp``, the module and the tp degrees that would work. Or
            tp > 1 shards nothing, no expert is split and ``allow_replicated`` (the spec's
            ``tensor_parallel.allow_replicated``) is false: names the first op that stopped it.
    """
    decision = TPDecision(tp=tp)
    sites = linear_sites(graph)
    decision.linears = list(dict.fromkeys(site.weight for site in sites))
    for site in sites:
        if site.bias:
            decision.biases[site.weight] = site.bias
    if tp == 1:
        return decision
    first = _pairs_settled(graph, sites, tp, decision)
    pairs, column, row, prop = first
    if not _divisible(prop, tp):
        # a group needs a size tp does not divide (3 heads at tp 2, 2 heads at tp 4): plan
        # as without its redistributions, that group then replicated (its conflict names
        # why), or with the linears behind heads tp is a multiple of kept whole, whichever
        # shards more; else the error below names the size and the tp degrees that divide it
        pairs, column, row, prop = _indivisible(graph, sites, tp, decision, first)
    _check_divisible(prop, tp)
    pairs, column, row, prop = _one_head_whole(graph, tp, decision, (pairs, column, row, prop))
    layouts = prop.found_layouts()
    decision.column, decision.row, decision.rewrites = column, row, prop.rewrites
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
            decision.layouts[w] = layouts[w] if site.merged is None else in_units(
                layouts[w], site.features(site.out_dim) // int(shape(site.param)[site.out_dim]))
        if w in column and site.bias in layouts:  # its weight's, or its pieces' side by side
            decision.layouts[site.bias] = layouts[site.bias]
    for fqn, (d, _groups) in sorted(prop.per_head.items()):
        decision.per_head[fqn] = decision.dims[fqn] = d
        decision.report.append(f"sharded along heads (dim {d}): {fqn}")
    for name, (d, _groups) in sorted(prop.narrow.items()):
        decision.narrows[name] = d
        decision.report.append(f"cut to each rank's heads (dim {d}): {_op_text(by_name[name])} "
                               f"(a replicated per-head value merged with the batch)")
    decision.redistributions = redistributions(graph, prop, tp)
    decision.report += report_lines(decision.redistributions)
    for w, layout in sorted(decision.layouts.items()):
        if w in column:
            decision.report.append(f"layout {layout.text()}: {w}")
    paired = {w for c, rows in pairs.items() if rows for w in {c} | rows}
    for site in sites:
        if site.weight not in paired:
            line = f"replicated linear: {site.weight} (no column/row pair found; {_op_text(site.node)})"
            decision.replicated.setdefault(site.weight, []).append(line)
            decision.report.append(line)
    decision.report += custom_op_weights(graph)
    decision.other_replicated = other_matrices(graph, decision)
    decision.report += list(decision.other_replicated.values())
    if not column:
        _nothing_sharded(decision, tp, allow_replicated, experts_split)
    else:  # the backward's f edges and Partial gradients, derived (planning/gradients.py)
        plan_gradients(graph, decision)
    return decision


def _pairs_settled(graph, sites, tp: int, decision: TPDecision):
    """Seed the pairs with walks that end at residual adds (a pair within a block, as
    Megatron-LM's), settle them; where that needs redistributions, also the pairs of walks
    that go on through the residual stream (a model whose residual stream is itself sharded
    between blocks), kept when they settle with none and shard no fewer elements: the
    cheaper program by communication. (Through the residual stream with redistributions,
    the walks pair a block's output projection with the next block's linears and cut the
    residual stream to meet them.)"""
    first = _candidate(graph, seed_pairs(sites, True), tp, decision)
    if first[1] and not (first[3].applied or first[3].applied_reduces):
        return first
    other = seed_pairs(sites, False)
    if other == first[0]:
        return first
    scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
    second = _candidate(graph, other, tp, scratch)
    size = _weight_sizes(graph)
    if second[3].applied or second[3].applied_reduces or sum(
            size.get(w, 0) for w in second[1] | second[2]) < sum(
            size.get(w, 0) for w in first[1] | first[2]):
        return first
    decision.blockers, decision.report = scratch.blockers, scratch.report
    return second


def _indivisible(graph, sites, tp: int, decision: TPDecision, first):
    """``first`` (the candidate that settled) needs a size tp does not divide. Two other
    plans: without redistributions (``first`` itself when it had none), and
    (:func:`_whole_kv`) with the column linears behind heads that tp is a multiple of kept
    whole. The whole one is taken when the plain one is not divisible either or it shards
    more weight elements."""
    plain, chosen = decision, first
    prop = first[3]
    if prop.applied or prop.applied_reduces:
        plain = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
        chosen = _candidate(graph, seed_pairs(sites, True), tp, plain, redistribute=False)
    whole = _whole_kv(graph, seed_pairs(sites, True), tp, decision, prop)
    size = _weight_sizes(graph)
    if whole is not None and (not _divisible(chosen[3], tp) or sum(
            size.get(w, 0) for w in whole[0][1] | whole[0][2]) > sum(
            size.get(w, 0) for w in chosen[1] | chosen[2])):
        chosen, plain = whole
    decision.blockers, decision.report = plain.blockers, plain.report
    return chosen


def _whole_kv(graph, pairs: dict, tp: int, decision: TPDecision, prop):
    """A plan keeping whole (replicated) the column linears whose shard reaches a heads view
    that tp does not divide but is a multiple of (OLMo-2's k: 2 kv heads at tp 4, normed over
    its whole projection before the view, so no rank can hold a copy of one head through
    the norm), their attention cutting each rank's copy of its kv head
    (analysis/sharding/redistribute.py, CopiedHeads): (candidate, its scratch decision), or
    None when another size is in the way or the plan does not settle divisible."""
    kept: dict = {}
    for _ in range(4):
        kv = frozenset(prop.kv_weights)
        bad = [c for c in prop.constraints if not c.allows(tp, kv)]
        if not bad:
            return None if not kept else (found, scratch)
        if any(c.what != "heads" or tp % c.size or not c.origin for c in bad):
            return None
        for c in bad:
            kept.update({w: _fewer_heads(c, tp) for w in c.origin if w not in kept})
        scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
        found = _candidate(graph, pairs, tp, scratch, kept=kept)
        prop = found[3]
    return None


def _fewer_heads(c, tp: int) -> str:
    where = f" ({c.note} spans them)" if c.note else ""
    return (f"in {c.module or 'the model'}, {c.detail} holds {c.size} heads, fewer than tp = "
            f"{tp}, where no rule keeps a copy of one head on each rank{where}")


def _one_head_whole(graph, tp: int, decision: TPDecision, chosen):
    """``chosen`` needs redistributions and shards a column linear whose output a view turns
    into one head (multi-query k normed over its projection first, OLMo-2 with one kv
    head): the shard lands on head_dim, which attention and rotary embeddings only take
    gathered (every rank then computes attention whole), or tp does not divide head_dim and
    attention stays replicated. The plan with those linears kept whole (attention cuts each
    rank's copy of the head) is taken when it settles divisible and shards more weight
    elements or sends fewer bytes per step."""
    pairs, column, row, prop = chosen
    paired = {c for c, rows in pairs.items() if rows}
    one = sorted(prop.one_head_dim & paired)
    if not one or not (prop.applied or prop.applied_reduces or column != paired):
        return chosen
    scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
    why = ("its output is one head (a view to [.., 1, head_dim]); split, it would be split "
           "along head_dim, which attention takes only gathered")
    found = _candidate(graph, pairs, tp, scratch, kept={w: why for w in one})
    size = _weight_sizes(graph)
    more = sum(size.get(w, 0) for w in found[1] | found[2]) > sum(
        size.get(w, 0) for w in column | row)
    if not _divisible(found[3], tp) or not more and _bytes_sent(
            graph, found[3], tp) >= _bytes_sent(graph, prop, tp):
        return chosen
    decision.blockers, decision.report = scratch.blockers, scratch.report
    return found


def _bytes_sent(graph, prop, tp: int) -> int:
    return sum(r.bytes or 0 for r in redistributions(graph, prop, tp))


def _weight_sizes(graph) -> dict:
    """get_attr target -> its number of elements."""
    out = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op == "get_attr" and isinstance(v, torch.Tensor):
            out[n.target] = v.numel()
    return out


def _candidate(graph, pairs: dict, tp: int, decision: TPDecision, redistribute: bool = True,
               kept=None):
    """Settle the pairs; ``kept``: column weights left whole (:func:`_whole_kv`,
    :func:`_one_head_whole`), each with why, reported."""
    kept = kept or {}
    column = {c for c, rows in pairs.items() if rows} - set(kept)
    row = {r for rows in pairs.values() for r in rows}
    for w, why in sorted(kept.items()):
        decision.report.append(
            f"kept whole: {w} ({why}; its readers take it whole, or cut to the rank's heads "
            f"or its copy of one)")
    prop = _settle(graph, pairs, column, row, tp, decision, redistribute)
    return pairs, column, row, prop


def linear_counts(decision: TPDecision, vocab_heads=()) -> str:
    """report.md's count of the linears by role, naming every one kept replicated (the LM
    heads vocab_parallel shards over the vocabulary are not: ``vocab_heads``), then the other
    weight matrices kept replicated (read by an op that is no linear: :func:`other_matrices`)."""
    heads = sorted(w for w in decision.linears if w in set(vocab_heads))
    kept = [w for w in decision.linears
            if w not in decision.column and w not in decision.row and w not in heads]
    other = list(decision.other_replicated)
    parts = [f"column_parallel: {len(decision.column)} linears",
             f"row_parallel: {len(decision.row)} linears"]
    if heads:
        parts.append(f"vocab_parallel LM head: {', '.join(heads)}")
    if kept:
        parts.append(f"replicated: {len(kept)} linears ({', '.join(kept)})")
    if other:
        parts.append(f"replicated{' too' if kept else ''}: {len(other)} other weight matrices "
                     f"({', '.join(other)})")
    if not kept and not other:
        parts.append("replicated: none")
    return "; ".join(parts)


# ops a weight is read through on its way to the op that uses it (the reason names that op)
_WEIGHT_PATH = frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.type_as.default, aten.contiguous.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten._assert_tensor_metadata.default})


def other_matrices(graph: fx.Graph, decision: TPDecision) -> dict:
    """fqn -> report line of every parameter of two or more dims that ``graph`` reads, that
    tensor parallelism leaves whole on every rank and that no other line accounts for: not a
    linear's weight (those are counted and named by role), not read by ``aten.embedding`` (the
    vocabulary planner reports tables), by an operator outside ATen (:func:`custom_op_weights`)
    or as stacked experts (the experts planner). The line names the op that reads it and its
    source line: an einsum that is no linear map (capture makes those linears: a per-head
    block-diagonal ``einsum("bshd,hde->bshe", x, w)``),
    a convolution, a mixing matrix of the heads. Per-head tensors cut to each rank's heads
    while the step runs (a redistribution) say so."""
    owner = graph.owning_module
    params = dict(owner.named_parameters()) if owner is not None else None
    linears = set(decision.linears)
    experts = {w for layer in find_expert_layers(graph)[0] for w in layer.weights}
    cut = {r.producer for r in decision.redistributions}
    out: dict = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op != "get_attr" or not isinstance(v, torch.Tensor) or v.dim() < 2 \
                or n.target in decision.dims or n.target in linears or n.target in experts \
                or n.target in out:
            continue
        if params is not None and n.target not in params:
            continue  # a buffer (rotary tables, masks): no weight
        readers = _readers(n)
        if not readers or any(u.target is aten.embedding.default for u, _ in readers) or any(
                getattr(u.target, "namespace", "aten") not in ("aten", "prims") for u, _ in readers):
            continue
        use, via = readers[0]
        shape_text = "x".join(str(d) for d in v.shape)
        producer = next((c for c in cut if c == n.name or c in via), None)
        if producer is not None:
            why = (f"each rank cuts its heads, or its copy of them, from it as the step runs: "
                   f"the redistribution of {producer}")
        else:
            why = ("no tensor-parallel rule splits a weight this op reads: only linear layers "
                   "(a product with a 2-D weight) and per-head tensors are sharded")
        out[n.target] = (f"replicated: {n.target} ({shape_text}, read by {_op_text(use)}: "
                         f"{why})")
    return out


def _readers(param: fx.Node) -> list:
    """(op, names of the weight-path nodes on the way) of each op reading ``param``, through
    casts, views and transposes (:data:`_WEIGHT_PATH`), in graph order."""
    found, frontier = [], [(param, frozenset())]
    while frontier:
        node, via = frontier.pop(0)
        for u in node.users:
            if u.op == "call_function" and u.target in _WEIGHT_PATH:
                if u.target is not aten._assert_tensor_metadata.default:
                    frontier.append((u, via | {u.name}))
            elif u.op != "output":
                found.append((u, via))
    return found


def custom_op_weights(graph: fx.Graph) -> list[str]:
    """Report lines for parameters read by operators outside ATen: no sharding rule covers
    them, so they stay replicated on every tp rank. The stacked weights of an expert layer
    (Mixtral's through ``transformers::grouped_mm_fallback``) are left to the experts
    planner, which splits them over tp or says why not (planning/experts.py)."""
    experts = {w for layer in find_expert_layers(graph)[0] for w in layer.weights}
    found: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "aten") not in (
                "aten", "prims"):
            for a in node.all_input_nodes:
                src = a
                while src.op == "call_function" and src.target in (
                        aten.transpose.int, aten.t.default, aten.permute.default,
                        aten._to_copy.default, aten.view.default, aten.reshape.default):
                    src = src.args[0]
                if src.op == "get_attr" and src.target not in experts:
                    found.setdefault(str(node.target).rsplit(".", 1)[0], []).append(src.target)
    return [f"kept replicated: {', '.join(sorted(set(ws)))} (read by {op}, an operator with no "
            f"tensor-parallel sharding rule)" for op, ws in found.items()]


def _op_text(node: fx.Node) -> str:
    where = source_line(node)
    return f"{node.target} at {where}" if where else str(node.target)


def _nothing_sharded(decision: TPDecision, tp: int, allow_replicated: bool,
                     experts_split: bool = False) -> None:
    """tp > 1 with nothing sharded: every rank would hold the whole model and only add
    all-reduces. An error unless the spec allows it (then a warning), or a warning that only
    the experts are split."""
    why = (f"the first op that stopped it: {decision.blockers[0]}" if decision.blockers else
           "no linear layer feeds another (a matmul with a 2-D parameter operand whose output "
           "reaches a second one)")
    if experts_split:
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


def block_matrices(model, blocks=()) -> dict:
    """fqn -> numel of the weight matrices (parameters of two or more dims: a linear's or an
    einsum's weight, a per-head 3-D projection, a convolution's kernel) in the model's blocks:
    the items of every ``nn.ModuleList`` (T5's encoder and decoder blocks) and ``blocks``
    (module FQNs, planning/blocks.py find_blocks: an ``nn.Sequential``'s or ``ModuleDict``'s
    items too)."""
    prefixes = _block_prefixes(model, blocks)
    return {n: p.numel() for n, p in model.named_parameters()
            if p.dim() >= 2 and n.startswith(prefixes)}


def _block_prefixes(model, blocks=()) -> tuple:
    import torch.nn as nn
    return tuple(f"{b}." for b in blocks) + tuple(
        f"{name}.{i}." for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) for i in range(len(m)))


def tp_summary(decision: TPDecision, model, vocab=None, blocks=(), experts=None,
               stacked=None) -> str:
    """``tensor parallel: N of M weight matrices in blocks sharded (P % of parameters)``:
    P counts the elements of every parameter (embeddings and norms too) that tp shards, the
    vocabulary tables of ``vocab`` (a VocabDecision) and the experts split along their FFN
    dim (``experts``: fqn -> tp dim, the EPDecision's ``dims``; ``stacked``: a stacked FQN ->
    the per-module experts it stands for, passes/stack_experts.py) too; the blocks are
    ``blocks`` where given (see :func:`block_matrices`). A model with no blocks (no
    ``nn.ModuleList``, none found by planning/blocks.py) says so and counts the weight
    matrices of the whole model instead. P is rounded, but never to 100 while a parameter is left whole (nor to 0
    while one is sharded)."""
    mats = block_matrices(model, blocks)
    where = "in blocks"
    if not _block_prefixes(model, blocks):
        mats = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
        where = "in the model"
    dims = {**decision.dims, **(vocab.dims if vocab is not None else {}), **(experts or {})}
    for fqn, members in (stacked or {}).items():
        if fqn in dims:
            dims.update(dict.fromkeys(members, dims[fqn]))
    sharded = [n for n in mats if n in dims]
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values()) or 1
    split = sum(p.numel() for n, p in params.items() if n in dims)
    pct = f"{100 * split / total:.0f}"
    if (pct == "100" and split < total) or (pct == "0" and split > 0):
        pct = f"{min(max(100 * split / total, 0.1), 99.9):.1f}"
    head = "tensor parallel: " if where == "in blocks" else \
        "tensor parallel: no repeated blocks found; "
    return (f"{head}{len(sharded)} of {len(mats)} weight matrices {where} sharded "
            f"({pct} % of parameters)")


def _settle(graph, pairs: dict, column: set, row: set, tp: int, decision,
            redistribute: bool = True) -> Propagation:
    """Propagate until the layouts found are the layouts assumed (the rewrites follow them)
    and no conflict is left; groups in conflict are removed from ``column``/``row``."""
    layouts, no_replication, per_head, narrow = {}, {}, {}, {}
    edges, reduces, one_head_dim = {}, {}, set()
    by_name = {n.name: n for n in graph.nodes}
    for _ in range(4 * (len(column) + len(row)) + len(by_name) + 8):
        # a per-head tensor whose attention was kept replicated stays replicated too
        per_head = {k: v for k, v in per_head.items() if v[1] & column}
        narrow = {k: v for k, v in narrow.items() if v[1] & column}
        prop = propagate(graph, column, row, tp, layouts, no_replication, per_head, narrow,
                         edges, reduces)
        one_head_dim |= prop.one_head_dim  # its linears may be dropped by the next round
        prop.one_head_dim = one_head_dim

        if prop.not_replicable - set(no_replication):
            for w in sorted(prop.not_replicable - set(no_replication)):
                no_replication[w] = prop.copies_end.get(w, "")
            continue
        new = {k: v for k, v in prop.head_requests.items() if k not in per_head and v[1] & column}
        if new:
            per_head.update(new)
            continue
        new = {k: v for k, v in prop.narrow_requests.items() if k not in narrow and v[1] & column}
        if new:
            narrow.update(new)
            continue
        found = prop.found_layouts()
        if found != layouts:
            layouts = found
            continue
        conflicts = prop.conflicts + [(n, "", frozenset({w}), r)
                                      for w, n, r in prop.layout_conflicts()]
        if not conflicts:
            return prop
        if redistribute and _redistribute(prop, edges, reduces):
            continue
        node, module, groups, reason = conflicts[0]
        bad = _component(pairs, groups or column)
        op = _op_text(by_name[node]) if node in by_name else node
        decision.blockers.append(f"{op} in {module or 'the root module'}: {reason}"
                                 + _indivisible_cause(prop, bad, tp))
        decision.report.append(f"kept replicated: {', '.join(sorted(bad))} (at {node} = "
                               f"{decision.blockers[-1]})")
        column -= bad
        row -= bad
    raise AssertionError("tp planning did not settle")  # each round removes or fixes something


def _indivisible_cause(prop: Propagation, bad: set, tp: int) -> str:
    """The heads (or features) of ``bad``'s modules that tp does not divide, named as the
    cause of the conflict they lead to (a per-head op on 2 kv heads split at tp 3); "" when
    every size divides."""
    kv = frozenset(prop.kv_weights)

    def ours(c) -> bool:
        return not c.allows(tp, kv) and (bool((c.weights | c.origin) & bad) or bool(
            c.module) and any(w.startswith(c.module + ".") for w in bad))
    # heads tp is a multiple of may be copies (their kv role not yet seen): named last
    sizes = sorted(filter(ours, prop.constraints),
                   key=lambda c: (c.what == "heads" and tp % c.size == 0, c.what != "heads"))
    if not sizes:
        return ""
    c = sizes[0]
    return (f"; the cause: tp = {tp} does not divide the {c.size} {c.what} of "
            f"{c.module or 'the model'} ({c.detail})")


def _redistribute(prop: Propagation, edges: dict, reduces: dict) -> bool:
    """Take the redistributions the run asked for (analysis/sharding/redistribute.py) into
    ``edges`` / ``reduces`` for the next run; False when it asked for none."""
    for (consumer, producer), want in prop.edge_requests.items():
        edges.setdefault(consumer, {})[producer] = want
    reduces.update(prop.reduce_requests)
    return bool(prop.edge_requests or prop.reduce_requests)


def _component(pairs: dict, seeds) -> set:
    """All column and row FQNs linked to ``seeds`` through shared pairs."""
    comp, changed = set(seeds), True
    while changed:
        changed = False
        for c, rows in pairs.items():
            if rows and (c in comp or rows & comp) and not ({c} | rows) <= comp:
                comp |= {c} | rows
                changed = True
    return comp


def _divisible(prop: Propagation, tp: int) -> bool:
    kv = frozenset(prop.kv_weights)
    return all(c.allows(tp, kv) for c in prop.constraints)


def _check_divisible(prop: Propagation, tp: int) -> None:
    kv = frozenset(prop.kv_weights)
    bad = [c for c in prop.constraints if not c.allows(tp, kv)]
    if not bad:
        return
    bad.sort(key=lambda c: c.what != "heads")
    c = bad[0]
    top = max(x.size for x in prop.constraints)
    valid = [t for t in range(1, top + 1) if all(x.allows(t, kv) for x in prop.constraints)]
    kv_heads = c.what == "heads" and c.replicable(kv)
    copies = ", or be a multiple of it (each kv head is then held by tp / kv heads ranks)"
    raise PlanError(
        f"mesh.tp ({tp}) must divide the number of {'kv heads' if kv_heads else c.what} "
        f"({c.size}) of {c.module or 'the model'} ({c.detail}){copies if kv_heads else ''}; "
        f"valid choices: tp in {{{', '.join(map(str, valid))}}}")
