"""Sequence-parallel planner: which values between the tensor-parallel regions run on a
sequence shard (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.2.2).

Reads the tp-rewritten graph (its f and g operators carry ``node.meta[TP_OPERATOR]``),
never changes it; the ``sequence_parallel`` pass applies the decision. A region grows from
the g operators (row_parallel outputs) forward through ops that act on each position alone
(pointwise ops, dropout, norms and reductions over the trailing dims, views that keep or
flatten (batch, seq)), and backward over replicated values whose every use is inside the
region or an f (the embedding's output and the first norm). The sequence is dim 1 of the
model's inputs (the compiler's convention: dim 0 batch, dim 1 sequence). Then:

- g -> reduce-scatter, f on a region value -> all-gather;
- a replicated value read by the region with the sequence on the aligned dim enters as the
  local slice (backward: all-gather); one broadcast over the sequence (a norm weight) that
  carries a parameter's gradient gets an f: each rank's gradient covers its shard only;
- a region value read outside (the LM head, the outputs) is all-gathered for that reader;
- a dropout in the region draws the full mask and applies its slice (the masks equal the
  unsharded program's);
- views' shape constants holding the global sequence length get the local one.

Ops outside these rules stop the region (their inputs are gathered): correct, only less
memory saved.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..plan.decisions import TP_OPERATOR, SequenceParallelDecision
from ..errors import PlanError
from ..analysis.graph_facts import aten, expr, module_path, prod, same, shape
from ..analysis.linears import VIEWS, reads_parameters
from ..analysis.sharding.placements import is_replicated
from ..analysis.writes import views_of
from ..frontend.graph_rewrite import returns_view, written_inputs

_COPIES = {aten.clone.default, aten.contiguous.default, aten._to_copy.default,
           aten.alias.default, aten.detach.default}
_TO = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten.type_as.default}
_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
               aten.var.correction, aten.var_mean.correction}
# dropouts whose output is the input times a mask (what a sequence shard can slice)
_MULTIPLICATIVE = {"aten.dropout.default", "aten.native_dropout.default",
                   "aten.feature_dropout.default"}


def plan_sequence_parallel(graph: fx.Graph, tp: int, mode: str, placements: dict,
                           dropout_sites=(), example_seq: Optional[int] = None,
                           blocks: tuple = ()) -> SequenceParallelDecision:
    """Decide the sequence-parallel regions of the tp-rewritten ``graph``.

    Args:
        mode: ``tensor_parallel.sequence_parallel``: "auto", "true" or "false".
        placements: node name -> tp placement (TPDecision.placements): values not
            Replicate under tensor parallelism are never sequence-sharded.
        dropout_sites: the DropoutSite records of the program (their nodes drew masks).
        example_seq: the example batch's sequence length (``--verify`` runs it): one not
            divisible by tp turns "auto" off (and fails "true").
        blocks: the model's blocks (planning/blocks.find_blocks), recorded for the pass.

    Raises:
        PlanError: ``mode`` is "true" and no region can be formed (names the blocker).
    """
    out = SequenceParallelDecision(tp=tp, blocks=tuple(blocks))
    if mode == "false" or tp == 1:
        if tp > 1:
            out.report.append("sequence parallel: off (tensor_parallel.sequence_parallel=false)")
        return out
    facts = _Facts(graph, placements, {s.node: s.op for s in dropout_sites})
    blocker = facts.blocker or _indivisible(example_seq, tp, facts) or _grow(facts)
    if blocker:
        if mode == "true":
            raise PlanError(f"tensor_parallel.sequence_parallel=true cannot apply: {blocker}; "
                            f"set tensor_parallel.sequence_parallel to auto or false")
        out.blocker = blocker
        out.report.append(f"sequence parallel: off ({blocker})")
        return out
    _decide(facts, out)
    return out


def sequence_note(decision: SequenceParallelDecision) -> str:
    """The compile's one line on sequence parallelism when it is on: the sequence lengths the
    program then runs, multiples of mesh.tp (a run of another length stops with an error
    naming it, which the compile had not said: zoo 23 F5). '' when it is off."""
    if not decision.enabled:
        return ""
    tp = decision.tp
    return (f"sequence parallel: on ({len(decision.region)} values held as sequence shards of "
            f"1/{tp}); the program runs sequence lengths that are multiples of mesh.tp ({tp}) "
            f"only; tensor_parallel.sequence_parallel=false runs any length")


def _indivisible(example_seq: Optional[int], tp: int, facts) -> Optional[str]:
    if example_seq is None or not example_seq % tp:
        return None
    if expr(facts.seq).is_number:  # a size of the model, not of the batch
        return (f"dim 1 of the first model input, {example_seq}, is a constant of the captured "
                f"graph, no sequence length (an image's channels, a feature dim), and mesh.tp "
                f"({tp}) does not divide it")
    return (f"the example batch's sequence length ({example_seq}) is not divisible by "
            f"mesh.tp ({tp}); make example_inputs() a multiple of {tp} long")


class _Facts:
    """The graph, the sequence and batch sizes, and the region being grown."""

    def __init__(self, graph, placements, dropouts):
        self.graph, self.placements, self.dropouts = graph, placements, dropouts
        self.region: dict = {}
        self.blocker = None
        self.seq = self.batch = self.seq_source = None
        for n in graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 2:
                self.batch, self.seq = v.shape[0], v.shape[1]
                self.seq_source = (n.name, 1) if isinstance(v.shape[1], torch.SymInt) \
                    else int(v.shape[1])
                break
        if self.seq is None:
            self.blocker = "no model input has a sequence dim (dim 1 of a 2-D or larger input)"

    def operator(self, n) -> Optional[str]:
        return n.meta.get(TP_OPERATOR) if isinstance(n, fx.Node) else None

    def seq_place(self, n) -> Optional[tuple]:
        """(dim, flat) of the sequence in ``n``'s value, or None: (batch, seq, ...), or
        (batch * seq, ...) flat. The batch is part of it: a table over positions that the
        model computes, (2 seq - 1, features) with as many features as a fixed sequence
        length (x-transformers' position-bias MLP), is no sequence shard."""
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if isinstance(v, (tuple, list)):
            v = v[0] if v and isinstance(v[0], torch.Tensor) else None
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            return None
        # a (batch, 12) value whose dim 1 is a constant is (batch, features): a table's row
        # per sample (TabNet), no sequence; its features are what a linear contracts, and
        # the fused gather + linear of a shard cut along them failed (zoo 25 F5)
        if same(v.shape[1], self.seq) and same(v.shape[0], self.batch) \
                and not same(v.shape[0], self.seq) \
                and (v.dim() > 2 or isinstance(v.shape[1], torch.SymInt)):
            return (1, False)
        if same(v.shape[0], expr(self.batch) * expr(self.seq)):
            return (0, True)
        return None


def _sharded_by_tp(facts, n) -> bool:
    return not is_replicated(facts.placements.get(n.name))


def _candidate(facts, n) -> Optional[tuple]:
    """The sequence placement ``n`` would have inside a region, or None if its op cannot
    run on a sequence shard (inputs are checked by :func:`_inputs_ok`)."""
    if n.op != "call_function" or _sharded_by_tp(facts, n) or facts.operator(n) == "f":
        return None
    place = facts.seq_place(n)
    if place is None:
        return None
    if facts.operator(n) == "g":
        return place
    t = n.target
    if t is _getitem():
        src = n.args[0]
        return place if isinstance(src, fx.Node) and src.target in (
            aten.native_layer_norm.default, aten.var_mean.correction) or \
            facts.dropouts.get(src.name) == "aten.native_dropout.default" or \
            str(src.target) == "aten.native_dropout.default" else None
    if n.name in facts.dropouts:
        return place if facts.dropouts[n.name] in _MULTIPLICATIVE else None
    if str(t) in _MULTIPLICATIVE:  # p = 0 or not training: returns its input
        return place
    if t in _NORMS:
        x = n.args[0]
        nd = x.meta["val"].dim()
        return place if place[0] < nd - len(n.args[1]) else None
    if t in _REDUCTIONS:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None:
            return None
        nd = n.args[0].meta["val"].dim()
        dims = [dims] if isinstance(dims, int) else list(dims)
        return place if all(d % nd > place[0] for d in dims) else None
    if t in VIEWS:
        return place if _view_ok(facts, n, place) else None
    if t in _TO or t in _COPIES or torch.Tag.pointwise in getattr(t, "tags", ()) or _whole_slice(n):
        return place
    return None


def _whole_slice(n: fx.Node) -> bool:
    """``x[:, 0:]``-style slices that keep every element (Hugging Face's
    ``hidden_states[:, slice(-0, None)]`` before the LM head with ``logits_to_keep=0``)."""
    if n.target is not aten.slice.Tensor:
        return False
    args = list(n.args) + [0, None, None, 1][len(n.args) - 1:]
    _x, _dim, start, end, step = args[:5]
    return start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2 ** 62))


def _getitem():
    import operator
    return operator.getitem


def _view_ok(facts, n, place) -> bool:
    """Views that keep (batch, seq) as the leading dims, or flatten / unflatten them, with
    the same trailing elements; a flattened size must be -1 (it is the local one then)."""
    src = facts.seq_place(n.args[0])
    if src is None:
        return False
    ins, outs, sizes = shape(n.args[0]), shape(n), list(n.args[1])
    if place == (1, False):
        lead = ins[0] if src == (1, False) else None
        trailing_in = ins[2:] if src == (1, False) else ins[1:]
        return (lead is None or same(lead, outs[0])) and same(prod(trailing_in), prod(outs[2:]))
    trailing_in = ins[2:] if src == (1, False) else ins[1:]
    return isinstance(sizes[0], int) and sizes[0] == -1 and same(prod(trailing_in), prod(outs[1:]))


def _inputs_ok(facts, n, place) -> bool:
    """Every tensor input of region node ``n`` is in the region with the aligned placement,
    enters it as a slice (sequence on the aligned dim), or broadcasts over the sequence."""
    if facts.operator(n) == "g":
        return True
    if n.target is _getitem():
        return n.args[0].name in facts.region
    return all(_edge(facts, n, place, a) != "bad" for a in n.all_input_nodes)


def _edge(facts, n, place, a) -> str:
    """How input ``a`` reaches region node ``n``: region | split | broadcast | bad."""
    v = a.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return "broadcast"  # sizes, scalars
    if a is n.args[0] and (n.target in VIEWS or n.target in _NORMS or n.target in _REDUCTIONS):
        want = facts.seq_place(a) if n.target in VIEWS else place
        if a.name in facts.region:
            return "region" if facts.region[a.name] == want else "bad"
        return "split" if want is not None and facts.seq_place(a) == want else "bad"
    dim, flat = place
    aligned = dim - (_ndim(n) - v.dim())
    if a.name in facts.region:
        return "region" if facts.region[a.name] == (aligned, flat) else "bad"
    if aligned < 0 or v.shape[aligned] == 1:
        return "broadcast"
    size = expr(facts.batch) * expr(facts.seq) if flat else facts.seq
    return "split" if same(v.shape[aligned], size) else "bad"


def _split_place(facts, n, place, a) -> tuple:
    """The placement input ``a`` enters the region with for reader ``n``."""
    if a is n.args[0] and (n.target in VIEWS or n.target in _NORMS or n.target in _REDUCTIONS):
        return facts.seq_place(a)
    return (place[0] - (_ndim(n) - a.meta["val"].dim()), place[1])


def _ndim(n) -> int:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = v[0]
    return v.dim()


def _grow(facts) -> Optional[str]:
    """Fill ``facts.region``; returns a blocker when there is no region. Grown again without
    the nodes of in-place writes that cross the region's edge (:func:`_split_writes`) until
    none does."""
    excluded: set = set()
    while True:
        blocker = _grow_once(facts, excluded)
        split = set() if blocker else _split_writes(facts)
        if not split:
            return blocker
        excluded |= split


def _split_writes(facts) -> set:
    """The nodes of each in-place write that crosses the region's edge: the writer, the
    tensor written with every view of it, and their readers, not all on one side. Across
    the edge a write reaches a copy (the gathered value a reader outside reads, the local
    slice a replicated value enters by, each made where the value is made), not the tensor
    the others read: ``y[:, 0].zero_()`` of a row's output zeroed each rank's first local
    position, or a gathered copy's (zoo 22 F3, an internal error at the self-check)."""
    out = set()
    for w in facts.graph.nodes:
        for _i, value in written_inputs(w):
            chain = [value]
            while returns_view(chain[-1]):
                chain.append(chain[-1].args[0])
            touched = {w, *chain} | views_of(chain[-1])
            touched |= {u for n in touched for u in n.users if u.target is not aten.sym_size.int}
            inside = [n.name in facts.region for n in touched]
            if any(inside) and not all(inside):
                out |= touched
    return out


def _grow_once(facts, excluded: set) -> Optional[str]:
    """:func:`_grow` with the nodes of ``excluded`` kept out of the region."""
    facts.region = {}
    cand = {}
    for n in facts.graph.nodes:
        p = None if n in excluded else _candidate(facts, n)
        if p is not None:
            cand[n] = p
    seeds = [n for n in cand if facts.operator(n) == "g"]
    if not seeds:
        gs = [n for n in facts.graph.nodes if facts.operator(n) == "g"]
        if not gs:
            return "no row_parallel linear (no g operator) to start a region from"
        return (f"the output of the row_parallel linear in {module_path(gs[0]) or 'the root module'} "
                f"has no sequence dim (dim 1 of the model's first input) to scatter along")
    region = set(seeds)
    frontier = list(seeds)
    while frontier:  # forward from the g operators
        for u in frontier.pop().users:
            if u in cand and u not in region:
                region.add(u)
                frontier.append(u)
    is_f = {n for n in facts.graph.nodes if facts.operator(n) == "f"}
    back = {n for n in cand if n not in region}
    changed = True
    while changed:  # backward: replicated values used only by the region and f
        changed = False
        for n in list(back):
            if any(u not in region and u not in back and u not in is_f for u in n.users):
                back.discard(n)
                changed = True
    region |= _connected(back, region)
    # in graph order, not the set's (Nodes hash by id): the pass inserts its operators in this
    # order, and the emitted program's names must not change from one compile to the next
    facts.region = {n.name: cand[n] for n in facts.graph.nodes if n in region}
    changed = True
    while changed:  # drop nodes whose inputs cannot be fed
        changed = False
        for n in list(region):
            if not _inputs_ok(facts, n, cand[n]):
                region.discard(n)
                del facts.region[n.name]
                changed = True
    if not any(facts.operator(n) == "g" for n in region):
        return "no row_parallel output could be scattered along the sequence"
    return None


def _connected(back: set, region: set) -> set:
    """Nodes of ``back`` linked to ``region`` through edges among ``back`` and ``region``, or
    through a value outside both that they read."""
    found, frontier = set(), [n for n in region]
    allowed = back | region
    seen = set(region)
    while frontier:
        n = frontier.pop()
        # siblings too: readers of one replicated value (the embedding's output feeds the
        # first norm and the first residual add) enter the region together
        siblings = [u for a in n.all_input_nodes if a not in allowed for u in a.users]
        for m in list(n.users) + n.all_input_nodes + siblings:
            if m in allowed and m not in seen:
                seen.add(m)
                frontier.append(m)
                if m in back:
                    found.add(m)
    return found


def _decide(facts, out: SequenceParallelDecision) -> None:
    out.enabled, out.region, out.seq = True, dict(facts.region), facts.seq_source
    by_name = {n.name: n for n in facts.graph.nodes}
    for name, place in facts.region.items():
        n = by_name[name]
        if facts.operator(n) == "g":
            out.reduce_scatter[name] = place
        if n.name in facts.dropouts:
            out.dropouts[name] = place
        for u in n.users:
            if facts.operator(u) == "f":
                out.all_gather[u.name] = place
            elif u.target is aten.sym_size.int and not place[1]:
                continue  # a size read: the pass gives it the global length, no gather
            elif u.name not in facts.region:
                out.exits.setdefault(name, []).append(u.name)
        if facts.operator(n) == "g" or n.target is _getitem():
            continue
        for a in n.all_input_nodes:
            kind = _edge(facts, n, place, a)
            if kind == "split":
                out.splits.setdefault(a.name, _split_place(facts, n, place, a))
            elif kind == "broadcast" and reads_parameters(a):
                out.param_inputs.append((name, a.name))
        if n.target in VIEWS and place == (1, False):
            sizes = n.args[1]
            if not (isinstance(sizes[1], int) and sizes[1] == -1):
                out.views[name] = [(1, 1)]
    _report(facts, out, by_name)


def _named(names, by_name) -> str:
    return ", ".join(f"{n} ({module_path(by_name[n]) or 'the root module'})" for n in sorted(names))


def _report(facts, out, by_name) -> None:
    tp = out.tp
    out.report.append(
        f"sequence parallel: on ({len(out.region)} values held as sequence shards of 1/{tp}; "
        f"{len(out.reduce_scatter)} g -> reduce-scatter, {len(out.all_gather)} f -> "
        f"all-gather, {len(out.splits)} value(s) enter by a local slice, "
        f"{sum(map(len, out.exits.values()))} read(s) outside gathered, "
        f"{len(out.param_inputs)} parameter read(s) with gradients summed over tp, "
        f"{len(out.dropouts)} dropout(s) applying their slice of the full mask)")
    if out.splits:
        out.report.append(f"enters the sequence-parallel region by a local slice: "
                          f"{_named(out.splits, by_name)}")
    if out.exits:
        out.report.append(f"gathered from the sequence shards for readers outside: "
                          f"{_named(out.exits, by_name)}")
    out.report.append(f"sequence parallel: the sequence length must be a multiple of "
                      f"mesh.tp ({tp}) at run time (checked; the program fails otherwise)")
