"""The state of one sharding-propagation run (:mod:`parallelizer.analysis.sharding.propagate`): what
the rules record (placements, rewrites of shape constants, divisibility constraints, layout
uses, kv-head markers) and the small helpers every rule uses to record it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch.fx as fx

from ...plan.layouts import InterleavedHeads, layout_json, local_offset, side_by_side
from ..graph_facts import aten, module_path, shape, source_line
from .placements import CONFLICT, REPLICATE, shard_dim


@dataclass(frozen=True)
class Constraint:
    """A global size that the tp degree must divide, or, for the heads of GQA kv projections
    (``weights`` all reach repeat_kv), divide or be a multiple of."""
    size: int
    what: str      # "heads", "features", ...
    module: str    # module FQN
    detail: str
    weights: frozenset = frozenset()  # for heads: the column weights whose output they split
    # the column weights whose shard reaches the value this size splits (a heads view of a
    # k normed over its whole projection: k_proj), for the planner's plan that keeps them whole
    origin: frozenset = frozenset()
    # why tp may not be a multiple of these heads (their copies were refused), for messages
    note: str = ""

    def replicable(self, kv_weights) -> bool:
        """Heads of weights whose output reaches repeat_kv (GQA kv heads) may be copied."""
        return bool(self.weights) and self.weights <= kv_weights

    def allows(self, tp: int, kv_weights=frozenset()) -> bool:
        if self.size % tp == 0:
            return True
        if not self.replicable(kv_weights):
            return False
        # the output features of a kv projection: its heads constraint decides
        return self.what == "features" or tp % self.size == 0


@dataclass
class Propagation:
    placements: dict = field(default_factory=dict)   # node name -> Placement (.placements)
    groups: dict = field(default_factory=dict)       # node name -> frozenset of column fqns
    rewrites: dict = field(default_factory=dict)     # node name -> [(arg, index, new_int)]
    conflicts: list = field(default_factory=list)    # (node name, module, groups, reason)
    constraints: list = field(default_factory=list)  # Constraint
    # layouts: column weight fqn -> layout (plan.layouts); "even" uses are recorded as None
    uses: dict = field(default_factory=dict)         # weight fqn -> {layout: node name}
    # row weights among ``uses``: theirs are the layouts of their input features (even, or
    # strided.py strided_features: heads inner)
    row_uses: set = field(default_factory=set)
    not_replicable: set = field(default_factory=set)  # weights whose kv heads cannot be copies
    copies_end: dict = field(default_factory=dict)  # such a weight -> the op that ended them
    # per-run inputs and value markers (see the module docstring)
    layouts: dict = field(default_factory=dict)      # the layouts this run assumes
    no_replication: frozenset = frozenset()
    no_replication_at: dict = field(default_factory=dict)  # weight -> the op that ended copies
    raw: dict = field(default_factory=dict)          # node name -> frozenset of weights
    heads: dict = field(default_factory=dict)        # node name -> HeadsMark
    claimed: set = field(default_factory=set)        # nodes whose rule set the markers
    features: dict = field(default_factory=dict)     # column weight fqn -> out features
    kv_weights: set = field(default_factory=set)     # column weights whose heads reach repeat_kv
    # column weights whose shard a view moved past one head onto its head_dim (B, T, 1, D)
    one_head_dim: set = field(default_factory=set)
    slices: dict = field(default_factory=dict)       # column weight -> [(lo, hi, node, module)]
    head_shapes: dict = field(default_factory=dict)  # column weight -> (heads, head_dim)
    column_biases: dict = field(default_factory=dict)  # separately added bias -> (weight, key)
    # column parameters read in pieces (pieces.py): fqn -> (size, {(lo, hi): {keys}}), and a
    # piece's key ("w[lo:hi]") -> its weight
    parts: dict = field(default_factory=dict)
    part_of: dict = field(default_factory=dict)
    # a view of a raw value into (heads, head_dim) whose users all cut the heads dim (Falcon's
    # q heads | k | v): node name -> (weights, head_dim); the cuts are fused parts in heads
    head_raw: dict = field(default_factory=dict)
    slice_units: dict = field(default_factory=dict)  # column weight -> head_dim of its cuts
    # a slice that is one part of a column output's features (Phi-3's qkv[..., a:b]) ->
    # (its weights, lo, hi), for the view of the part into heads (cuts.py sliced_heads)
    part_slices: dict = field(default_factory=dict)
    # a part of a column output held whole as one head with no heads dim (CopiedWhole):
    # node name -> its column weights
    copied_whole: dict = field(default_factory=dict)
    # (batch, heads) merged into one dim with the heads inner and sharded (BLOOM's baddbmm
    # operands; DTensor's _StridedShard): node name -> global heads; the placement is that dim
    strided: dict = field(default_factory=dict)
    strided_sizes: dict = field(default_factory=dict)  # size node -> views whose dim it sizes
    size_copies: dict = field(default_factory=dict)  # rewritten size node -> replicated users
    local_sizes: set = field(default_factory=set)  # merged-size nodes read from a rank's piece
    # replicated values each rank cuts to its block along a dim (ALiBi slopes before the
    # repeat that merges them with the batch): node name -> (dim, column groups)
    narrow: dict = field(default_factory=dict)
    narrow_requests: dict = field(default_factory=dict)
    # per-head tensors (heads.py): fqn / factory node name -> (dim, column groups)
    per_head: dict = field(default_factory=dict)
    per_head_factories: dict = field(default_factory=dict)
    head_requests: dict = field(default_factory=dict)  # ("param"|"factory", name) -> (dim, groups)
    # redistributions where no sharded rule takes a value as it is (redistribute.py):
    # consumer node name -> {producer node name: the placement the consumer reads it in}
    # (an all-gather to Replicate, or a cut of a replicated value to Shard), and node name ->
    # the reduce op ("sum" | "avg") of the all-reduce after an op with a Partial output
    edges: dict = field(default_factory=dict)
    reduces: dict = field(default_factory=dict)
    edge_requests: dict = field(default_factory=dict)    # (consumer, producer) -> placement
    reduce_requests: dict = field(default_factory=dict)  # node name -> reduce op
    applied: dict = field(default_factory=dict)          # the edges this run used
    applied_reduces: dict = field(default_factory=dict)  # the reduces this run used

    def found_layouts(self) -> dict:
        """weight fqn (or a piece's key) -> its one non-even layout (weights used in several
        ways excluded: :func:`layout_conflicts` names them); a parameter read in pieces, and
        a column linear's bias, the layout of its pieces side by side (pieces.py)."""
        out = {}
        for w, uses in self.uses.items():
            uses = _merged(uses)
            if len(uses) == 1 and next(iter(uses)) is not None:
                out[w] = next(iter(uses))
        found = dict(out)
        for param, (n, reads) in self.parts.items():
            try:
                layout = _side_by_side(n, reads, found)
            except ValueError:  # layout_conflicts names it
                continue
            if layout is not None:
                out[param] = layout
        return out

    def layout_conflicts(self) -> list:
        """(weight, node name, reason) for weights whose output is used in two layouts, or
        whose pieces cannot be laid out side by side."""
        out = []
        for w, uses in sorted(self.uses.items()):
            uses = _merged(uses)
            if len(uses) > 1:  # named at a read in a layout other than the even split
                odd = [n for u, n in uses.items() if u is not None] or list(uses.values())
                what = "input is read" if w in self.row_uses else "output is used"
                out.append((self.part_of.get(w, w), sorted(odd)[0], f"{w}'s {what} "
                            "both as " + " and as ".join(_describe(u) for u in
                                                        sorted(uses, key=_text))))
        found = self.found_layouts()
        for param, (n, reads) in sorted(self.parts.items()):
            try:
                _side_by_side(n, reads, found)
            except ValueError as e:
                keys = sorted(k for ks in reads.values() for k in ks)
                node = next((u for k in keys for u in self.uses.get(k, {}).values()), param)
                out.append((self.part_of.get(keys[0], keys[0]), node,
                            f"{param} cannot be laid out over tp: {e}"))
        return out


def _side_by_side(n: int, reads: dict, found: dict):
    """The layout of a parameter whose ranges are read by the linears of the keys in
    ``reads`` (their layouts in ``found``); ValueError as :func:`side_by_side`, or when one
    range is read in two layouts."""
    ranges = []
    for (lo, hi), keys in reads.items():
        layouts = {found.get(k) for k in keys}
        if len(layouts) > 1:
            raise ValueError(f"its rows [{lo}, {hi}) are read in {len(layouts)} layouts")
        ranges.append((lo, hi, layouts.pop()))
    return side_by_side(n, ranges)


def _text(layout) -> str:
    """The order uses are named in: by their JSON text (``null`` for the even split)."""
    return json.dumps(layout_json(layout), sort_keys=True)


def _merged(uses: dict) -> dict:
    """interleaved_heads is the even split, recorded for converters: it absorbs even uses."""
    if None in uses and any(isinstance(u, InterleavedHeads) for u in uses):
        return {u: n for u, n in uses.items() if u is not None}
    return uses


@dataclass(frozen=True)
class HeadsMark:
    """A value whose sharded dim is the heads of ``weights``' output (``heads`` globally).
    ``replicated``: each rank holds one copy of a head (tp > heads); ``expanded``: after
    repeat_kv's expand, the sharded (heads, n_rep) dim pair."""
    weights: frozenset
    heads: int
    replicated: bool
    expanded: bool = False


def _describe(layout) -> str:
    return "an evenly split tensor" if layout is None else f"a {layout.kind} tensor"


def inputs_of(node):
    return [a for a in node.all_input_nodes]


def placement(prop, n):
    """The placement of node ``n`` (Replicate for a constant or a node not yet placed)."""
    return prop.placements.get(n.name, REPLICATE) if isinstance(n, fx.Node) else REPLICATE


def dim_of(prop, n):
    """The dim ``n`` is sharded on, or None (replicated)."""
    return shard_dim(placement(prop, n))


def mark_not_replicable(prop, marks, node=None) -> None:
    """The copied kv heads of ``marks`` reach ``node``, an op no rule takes them through."""
    for m in marks:
        if m.replicated:
            prop.not_replicable |= m.weights
            if node is not None:
                for w in m.weights:
                    prop.copies_end.setdefault(w, op_text(node))


def op_text(node) -> str:
    """``aten.mean.dim (mean) at model.py:20``, for messages."""
    where = source_line(node)
    return f"{node.target} ({node.name})" + (f" at {where}" if where else "")


def record_use(prop, weights, layout, node) -> None:
    """``node`` uses the output of ``weights`` as laid out ``layout`` (None: evenly)."""
    name = node if isinstance(node, str) else node.name
    for w in weights:
        prop.uses.setdefault(w, {}).setdefault(layout, name)


def copyable(prop, weights) -> frozenset:
    """``weights`` for a heads constraint that tp may also be a multiple of (their kv heads
    copied), or none when a previous run refused their copies (``no_replication``: an op
    over the heads themselves, ``k - k.mean(1)``): their heads are then split evenly, and
    tp must divide them (else the planner keeps the projection whole, tp_candidates.py _whole_kv)."""
    weights = frozenset(weights)
    return frozenset() if weights & prop.no_replication else weights


def copies_refused(prop, weights) -> str:
    """The op that refused the kv-head copies of ``weights`` in a previous run (``aten.mean.dim
    (mean) at model.py:20``: a mean over the heads themselves), else ""."""
    ops = sorted({prop.no_replication_at[w] for w in weights if prop.no_replication_at.get(w)})
    return ops[0] if ops else ""


def local_at(at: int, layout, tp: int) -> int:
    """``plan.layouts.local_offset``, or ``at // tp`` where the layout assumed has a part tp
    does not divide (the part's constraint reports it; the plan is not taken)."""
    try:
        return local_offset(at, layout, tp)
    except ValueError:
        return at // tp


def add_constraint(prop, size, what, module, detail, weights=frozenset(), origin=frozenset(),
                   note=""):
    prop.constraints.append(Constraint(int(size), what, module, detail, frozenset(weights),
                                       frozenset(origin), note))


def add_rewrite(prop, node, arg_index, list_index, new):
    """Set ``node.args[arg_index]`` (its item ``list_index``) to ``new`` in the tp pass, or
    the keyword argument ``arg_index`` names (a str: ``output_size``); for ``unflatten`` the
    output dim ``list_index`` of :func:`sizes_arg` is its sizes' item."""
    if node.target is aten.unflatten.int and arg_index == 1:
        arg_index, list_index = 2, list_index - _unflatten_dim(node)
    prop.rewrites.setdefault(node.name, []).append((arg_index, list_index, new))


def sizes_arg(node):
    """The output sizes a view-like op spells: view/reshape/expand's, or for ``unflatten(x,
    dim, sizes)`` one per output dim (None for the dims it keeps); None for each of a
    flatten's."""
    if node.target is aten.flatten.using_ints:  # spells no sizes
        return [None] * len(shape(node))
    if node.target is aten.unflatten.int:
        dim, sizes = _unflatten_dim(node), list(node.args[2])
        return [None] * dim + sizes + [None] * (len(shape(node)) - dim - len(sizes))
    return list(node.args[1])


def _unflatten_dim(node) -> int:
    return node.args[1] % len(shape(node.args[0]))


def dim_arg(node, i, rank=None):
    d = node.args[i] if len(node.args) > i else node.kwargs.get("dim", 0)
    rank = len(shape(node.args[0])) if rank is None else rank
    return d % rank if isinstance(d, int) else d


def conflict(prop: Propagation, node: fx.Node, groups, reason: str):
    """Record that ``node`` cannot take its inputs' placements (``reason``), to the blame of
    the layer ``groups`` that reach it; (CONFLICT, groups) for the rule to return."""
    prop.conflicts.append((node.name, module_path(node), groups, reason))
    return CONFLICT, groups
