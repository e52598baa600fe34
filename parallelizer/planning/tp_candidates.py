"""Candidate tp plans and the choice between them (:func:`parallelizer.planning.tp.plan_tp`):
settle column/row pairs by sharding propagation, with redistributions or without, through
the residual stream or within blocks, with linears kept whole where tp cannot split their
heads (copied kv heads, decision 68) or where a split would land on one head's head_dim
(decision 69); divisibility of every sharded size. Planners never touch graphs: this reads
the graph and fills decisions."""
from __future__ import annotations

import torch

from ..plan.decisions import TPDecision
from ..plan.layouts import check, in_units
from ..errors import PlanError
from ..analysis.graph_facts import module_path, shape
from ..analysis.linears import linear_sites
from ..analysis.sharding.propagate import Propagation, propagate
from .redistributions import redistributions
from .tp_matrices import op_text
from .tp_seeds import seed_pairs
from .tp_sizes import divisible, indivisible_cause, not_dividing, sizes_text, valid_degrees


def pairs_settled(graph, sites, tp: int, decision: TPDecision):
    """Seed the pairs with walks that end at residual adds (a pair within a block, as
    Megatron-LM's), settle them; where that needs redistributions, also the pairs of walks
    that go on through the residual stream (a model whose residual stream is itself sharded
    between blocks), kept when they settle with none and shard no fewer elements: the
    cheaper program by communication. (Through the residual stream with redistributions,
    the walks pair a block's output projection with the next block's linears and cut the
    residual stream to meet them.)"""
    first = candidate(graph, seed_pairs(sites, True), tp, decision)
    if first[1] and not (first[3].applied or first[3].applied_reduces):
        return first
    other = seed_pairs(sites, False)
    if other == first[0]:
        return first
    scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
    second = candidate(graph, other, tp, scratch)
    size = _weight_sizes(graph)
    if second[3].applied or second[3].applied_reduces or sum(
            size.get(w, 0) for w in second[1] | second[2]) < sum(
            size.get(w, 0) for w in first[1] | first[2]):
        return first
    decision.blockers, decision.report = scratch.blockers, scratch.report
    return second


def indivisible(graph, sites, tp: int, decision: TPDecision, first, experts_split=False):
    """``first`` (the candidate that settled) needs a size tp does not divide. Three other
    plans: without redistributions (``first`` itself when it had none), with the column
    linears behind heads that tp is a multiple of kept whole (:func:`_whole_kv`), and with
    the pair groups behind every size tp does not divide kept whole
    (:func:`_whole_indivisible`). Of those that are divisible, the one sharding the most
    weight elements is taken, the earlier on a tie; when none is, the plain one (its
    sizes are then refused by ``tp_sizes.check_divisible``). A plan sharding no linear counts
    only where ``experts_split`` (the experts planner splits expert FFNs over tp: GraniteMoE
    with 3 kv heads at tp 2 keeps attention whole and runs its experts split)."""
    plain, chosen = decision, first
    prop = first[3]
    if prop.applied or prop.applied_reduces:
        plain = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
        chosen = candidate(graph, seed_pairs(sites, True), tp, plain, redistribute=False)
    options = [(chosen, plain), _whole_indivisible(graph, tp, decision, first)]
    kv = _whole_kv(graph, seed_pairs(sites, True), tp, decision, prop)
    if kv is not None:  # other sizes left (OLMo-2's FFN of 37 at tp 4): those groups whole too
        found, scratch, kept = kv
        options.append((found, scratch) if divisible(found[3], tp) else
                       _whole_indivisible(graph, tp, decision, found, kept))
    options = [o for o in options if o is not None]
    size = _weight_sizes(graph)

    def sharded(option) -> int:
        found = option[0]
        return sum(size.get(w, 0) for w in found[1] | found[2]) if found[1] | found[2] else -1
    # a plan keeping everything whole would hide the size and the degrees that divide it
    fits = [o for o in options if divisible(o[0][3], tp)
            and (o is options[0] or sharded(o) >= 0 or experts_split)]
    best = max(fits, key=sharded) if fits else options[0]
    if best is not options[0]:
        best[1].warnings.append(_kept_warning(tp, first, best[0]))
    chosen, plain = best
    if plain is not decision:
        decision.blockers, decision.report = plain.blockers, plain.report
        decision.replicated.update(plain.replicated)
        decision.warnings += plain.warnings
    return chosen


def _whole_kv(graph, pairs: dict, tp: int, decision: TPDecision, prop):
    """A plan keeping whole (replicated) the column linears whose shard reaches a heads view
    that tp does not divide but is a multiple of (OLMo-2's k: 2 kv heads at tp 4, normed over
    its whole projection before the view, so no rank can hold a copy of one head through
    the norm), their attention cutting each rank's copy of its kv head
    (analysis/sharding/redistribute.py, CopiedHeads): (candidate, its scratch decision, the
    linears kept whole), the candidate not divisible when another size is in the way; None
    when it keeps nothing whole or does not settle."""
    kept: dict = {}
    found = scratch = None  # set with the first kept linear
    for _ in range(4):
        kv = frozenset(prop.kv_weights)
        # sizes other than heads are left to _whole_indivisible (an FFN of 37 as well)
        bad = [c for c in prop.constraints if not c.allows(tp, kv) and c.what == "heads"]
        if any(tp % c.size or not c.origin for c in bad):
            return None
        new = {w: _fewer_heads(c, tp) for c in bad for w in sorted(c.origin) if w not in kept}
        if not new:
            return (found, scratch, kept) if kept else None
        kept.update(new)
        scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
        found = candidate(graph, pairs, tp, scratch, kept=kept)
        prop = found[3]
    return None


def _fewer_heads(c, tp: int) -> str:
    where = f" ({c.note} spans them)" if c.note else ""
    return (f"in {c.module or 'the model'}, {c.detail} holds {c.size} heads, fewer than tp = "
            f"{tp}, where no rule keeps a copy of one head on each rank{where}")


def one_head_whole(graph, tp: int, decision: TPDecision, chosen):
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
    why = ("its output is one head ([.., 1, head_dim] by a view, or [.., 1, tokens, head_dim] "
           "by an unsqueeze); split, it would be split "
           "along head_dim, which attention takes only gathered")
    found = candidate(graph, pairs, tp, scratch, kept={w: why for w in one})
    size = _weight_sizes(graph)
    more = sum(size.get(w, 0) for w in found[1] | found[2]) > sum(
        size.get(w, 0) for w in column | row)
    if not divisible(found[3], tp) or not more and _bytes_sent(
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


_TWO_ROLES = ("read by two linears along different dims (one linear's W and, transposed, "
              "another's: a tied v / o projection); the pass gives a parameter one role")


def _two_roles(graph, column: set, row: set) -> list[str]:
    """Weights of ``column`` or ``row`` that some linear reads in the other role: in both
    sets, or a row weight whose other reader has its sharded dim as output features (a
    projection ``x W^T`` and an output ``y (W^T)^T`` sharing W). The tensor_parallel pass
    rewrites every reader of a weight by the weight's one role."""
    dims: dict = {}
    for site in linear_sites(graph):
        w = site.weight
        if w in column or w in row:
            dims.setdefault(w, set()).add(site.out_dim if w in column else site.in_dim)
    return sorted(w for w, d in dims.items() if len(d) > 1 or (w in column and w in row))


def candidate(graph, pairs: dict, tp: int, decision: TPDecision, redistribute: bool = True,
               kept=None):
    """Settle the pairs; ``kept``: column weights left whole (:func:`_whole_kv`,
    :func:`one_head_whole`), each with why, reported."""
    kept = dict(kept or {})
    column = {c for c, rows in pairs.items() if rows}
    row = {r for rows in pairs.values() for r in rows}
    kept.update({w: _TWO_ROLES for w in _two_roles(graph, column, row) if w not in kept})
    column, row = column - set(kept), row - set(kept)
    for w, why in sorted(kept.items()):
        decision.report.append(
            f"kept whole: {w} ({why}; its readers take it whole, or cut to the rank's heads "
            f"or its copy of one)")
    prop = _settle(graph, pairs, column, row, tp, decision, redistribute)
    return pairs, column, row, prop


def _settle(graph, pairs: dict, column: set, row: set, tp: int, decision,
            redistribute: bool = True) -> Propagation:
    """Propagate until the layouts found are the layouts assumed (the rewrites follow them)
    and no conflict is left; groups in conflict are removed from ``column``/``row``."""
    layouts, no_replication, per_head, narrow = {}, {}, {}, {}
    edges, reduces, one_head_dim = {}, {}, set()
    by_name = {n.name: n for n in graph.nodes}
    seen: list = []  # the layouts assumed so far: one found again is a cycle, not progress
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
        # layouts settle before per-head cuts are asked for: a cut asked under a layout about
        # to change is stale (litgpt's rotary cos cut along head_dim, asked while its
        # one-head k part was still split evenly, then ended that head's copies)
        found = prop.found_layouts()
        cycle = found != layouts and found in seen
        if found != layouts and not cycle:
            seen.append(layouts)
            layouts = found
            continue
        new = {k: v for k, v in prop.head_requests.items() if k not in per_head and v[1] & column}
        if new:
            per_head.update(new)
            continue
        new = {k: v for k, v in prop.narrow_requests.items() if k not in narrow and v[1] & column}
        if new:
            narrow.update(new)
            continue
        conflicts = _alternating(graph, layouts, found) if cycle else prop.conflicts + [
            (n, "", frozenset({w}), r) for w, n, r in prop.layout_conflicts()]
        if not conflicts:
            return prop
        if redistribute and _redistribute(prop, edges, reduces):
            continue
        node, module, groups, reason = conflicts[0]
        # a bias's layout flips with its weight's: the weight names the group to drop
        groups = frozenset(decision.biases.get(g, g) for g in groups)
        bad = _left_unpaired(pairs, groups & (column | row), column, row) if groups & (
            column | row) else _component(pairs, column)
        op = op_text(by_name[node]) if node in by_name else node
        module = module or (module_path(by_name[node]) if node in by_name else "")
        decision.blockers.append(f"{op} in {module or 'the root module'}: {reason}"
                                 + indivisible_cause(prop, _component(pairs, bad), tp))
        decision.report.append(f"kept replicated: {', '.join(sorted(bad))} (at {node} = "
                               f"{decision.blockers[-1]})")
        column -= bad
        row -= bad
        seen.clear()
        # the redistributions asked for met the layouts of the linears dropped: asked anew
        edges.clear()
        reduces.clear()
    raise AssertionError("tp planning did not settle")  # each round removes or fixes something


def _alternating(graph: torch.fx.Graph, assumed: dict, found: dict) -> list:
    """Conflicts for the weights whose layouts alternate: propagated with one layout a weight
    needs another, and with that one the first again (ZAYA's k_proj at tp 4, fewer kv heads
    than ranks, read both per head and through a grouped convolution over q|k channels).
    Neither plan is consistent, so each such weight's group is kept replicated."""
    flips = sorted(w for w in assumed.keys() | found.keys() if assumed.get(w) != found.get(w))
    reader = {n.target: next(iter(n.users), n).name for n in graph.nodes if n.op == "get_attr"}
    return [(reader.get(w, w), "", frozenset({w}),
             f"its layout does not settle (assumed {assumed.get(w) or 'even'}, the propagation "
             f"then needs {found.get(w) or 'even'}, and back)") for w in flips]


def _redistribute(prop: Propagation, edges: dict, reduces: dict) -> bool:
    """Take the redistributions the run asked for (analysis/sharding/redistribute.py) into
    ``edges`` / ``reduces`` for the next run; False when it asked for none."""
    for (consumer, producer), want in prop.edge_requests.items():
        edges.setdefault(consumer, {})[producer] = want
    reduces.update(prop.reduce_requests)
    return bool(prop.edge_requests or prop.reduce_requests)


def _left_unpaired(pairs: dict, groups, column: set, row: set) -> set:
    """The linears a conflict keeps whole: the groups whose layouts reached it and the
    linears they leave with no partner (a row none of whose columns is left, a column none
    of whose rows is). Only those: a row that another column still feeds stays paired
    (a graph transformer's attention output projection, which the walk through the residual
    stream also pairs with the node encoder that a message-passing conflict drops), and the
    next propagation checks the layouts that are left."""
    gone, changed = set(groups), True
    while changed:
        changed = False
        for c, rows in pairs.items():
            if c in column and c not in gone and rows and rows & row <= gone:
                gone.add(c)
                changed = True
        fed = {r for c, rows in pairs.items() if c in column and c not in gone for r in rows}
        orphans = (row - gone) - fed
        if orphans:
            gone |= orphans
            changed = True
    return gone


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


def replicated_plan(graph, tp: int, decision: TPDecision, prop: Propagation):
    """The plan sharding nothing, for ``tensor_parallel.allow_replicated`` where ``prop``
    needs a size tp does not divide and no plan keeps only its groups whole: the size is
    the blocker the compile's warning names."""
    decision.blockers = [f"tp must divide {sizes_text(not_dividing(prop, tp), prop)}"]
    return candidate(graph, {}, tp, TPDecision(tp=tp, linears=decision.linears,
                                                biases=decision.biases))


def _whole_indivisible(graph, tp: int, decision: TPDecision, first, kept=None):
    """The plan with the pair groups behind each size tp does not divide (an FFN of 37
    features at tp 2, 4 heads at tp 3) kept whole (replicated on every tp rank, their
    column/row pairs dropped) and the rest sharded as in ``first``, which needs those sizes:
    (candidate, its scratch decision, with the ``kept whole:`` lines among its replicated
    linears), or None
    when a size names no group (one at the model's root) or the plan does not settle
    divisible. A size is behind a group when its constraint names the group's weights or
    sits in the module of one of its column linears. ``kept``: column linears ``first``
    already keeps whole (:func:`_whole_kv`), kept so."""
    pairs, column, row, prop = first
    why, found, scratch = {}, None, None
    for _ in range(8):
        bad = not_dividing(prop, tp)
        if not bad:
            break
        new = {}
        for c in bad:
            # the weights it names, else the column linears in its module (a module that
            # holds attention and the MLP inline names both: the named ones are precise)
            behind = ((c.weights | c.origin) & (column | row)) or {
                w for w in column if c.module and w.startswith(c.module + ".")}
            kv = c.what == "heads" and c.replicable(frozenset(prop.kv_weights))
            for w in _component(pairs, behind) - set(why) - set(new) if behind else ():
                new[w] = (f"tp = {tp} does not divide the {c.size} {'kv heads' if kv else c.what}"
                          f" of {c.module or 'the model'} ({c.detail})")
        if not new:
            return None
        why.update(new)
        scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
        left = {c: set() if c in why else rows - set(why) for c, rows in pairs.items()}
        found = candidate(graph, left, tp, scratch, kept=kept)
        prop = found[3]
    if found is None or not_dividing(prop, tp):
        return None
    for w, reason in why.items():  # plan_tp reports them among the replicated linears
        scratch.replicated[w] = [f"kept whole: {w} ({reason})"]
    return found, scratch


def _kept_warning(tp: int, first, chosen) -> str:
    """The compile's warning for a plan keeping the linears of ``first``'s pairs whole
    that ``chosen`` does not shard, for the sizes ``first`` needed: those sizes and the
    degrees that shard everything."""
    pairs, prop = first[0], first[3]
    paired = {w for c, rows in pairs.items() if rows for w in {c} | rows}
    kept = sorted(paired - chosen[1] - chosen[2])
    bad, valid = not_dividing(prop, tp), valid_degrees(prop)[1:]
    every = (f"tp in {{{', '.join(map(str, valid))}}} shards them too" if valid else
             "no tp > 1 divides every size")
    mods = sorted({w.rsplit(".", 1)[0] for w in kept})
    where = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
    rest = "the rest sharded" if chosen[1] | chosen[2] else "only the experts split"
    return (f"mesh.tp={tp} keeps {len(kept)} linears whole on every tp rank ({where}), "
            f"{rest}: tp must divide {sizes_text(bad, prop)}; {every}; see report.md")


def merged_layout(site, layout):
    """A column weight's layout in its parameter's own units: a parameter of 3+ dims viewed
    as the 2-D weight (an einsum projection) is cut along its own dim, so the layout is
    counted in that dim's rows (``plan.layouts.in_units``)."""
    if site.merged is None:
        return layout
    return in_units(layout, site.features(site.out_dim) // int(shape(site.param)[site.out_dim]))


def _merged_reason(site, layout, e: ValueError) -> str:
    """Why a merged parameter is kept whole: the checkpoint cuts it along its first output
    dim only, and its layout asks for cuts within that dim's rows (a stacked q|k|v einsum
    weight ``(3, H, D, D_h)``: each of the 3 parts cut along its heads, zoo 24 F1; the reason
    read "(tp degree 2 does not divide a fused part (1))")."""
    dims = list(shape(site.param))
    parts = getattr(layout, "parts", ())
    cut = f"its parameter {dims} can be cut only along dim {site.out_dim}, which holds"
    if len(parts) != dims[site.out_dim]:  # no parts dim to store after the heads: no advice
        return f"{cut} rows its {layout.kind} layout cuts within ({e})"
    return (f"{cut} its {len(parts)} fused parts, each of which tp would cut; stored with the "
            f"dim to cut first (the heads before the parts), it is sharded")


def merged_whole(graph, sites, tp: int, decision: TPDecision, chosen):
    """``chosen`` lays out a merged parameter's rows in parts its own dim cannot cut (a fused
    q|k|v einsum weight ``(3, H, D_h, D)``: the shard of each part is a slice of ``H``, but
    the parameter is cut along its first dim, the 3 parts): the plan with those linears kept
    whole, which must settle divisible; else a PlanError naming them."""
    pairs, column, _row, prop = chosen
    layouts = prop.found_layouts()
    bad = {}
    for site in sites:
        w = site.weight
        if site.merged is None or w not in column or w not in layouts:
            continue
        try:
            check(int(shape(site.param)[site.out_dim]), merged_layout(site, layouts[w]), tp)
        except ValueError as e:
            bad[w] = _merged_reason(site, layouts[w], e)
    if not bad:
        return chosen
    scratch = TPDecision(tp=tp, linears=decision.linears, biases=decision.biases)
    found = candidate(graph, pairs, tp, scratch, kept=bad)
    if not divisible(found[3], tp):
        w, why = sorted(bad.items())[0]
        raise PlanError(f"mesh.tp ({tp}) cannot shard {w}: {why}; or set mesh.tp=1")
    decision.blockers, decision.report = scratch.blockers, scratch.report
    return found
