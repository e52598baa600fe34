"""The planners' decisions that the passes read, as data: weights by parameter FQN, blocks
by module FQN, shape-constant rewrites by node name of the captured graph (the one the
passes rewrite). ``passes/``
depends on this module, never on ``planning/`` (docs/architecture.md: plans are data, passes read
plans, passes never choose).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


# node.meta key the tensor_parallel pass sets on the Megatron operators it inserts: "f"
# (copy_to_tp_region) or "g" (reduce_from_tp_region); later planners find them by it
TP_OPERATOR = "tp_operator"


@dataclass(frozen=True)
class Redistribution:
    """A redistribution the tp planner inserts where no sharded rule takes a value as it is
    (analysis/sharding/redistribute.py), applied by the tensor_parallel pass.

    ``kind``: "all_gather" (Shard(dim) -> Replicate; runtime/tp.py gather_from_tp_dim),
    "scatter" (Replicate -> Shard(dim), each rank's block; scatter_to_tp_region),
    "scatter_copies" (Replicate -> the copy of one of fewer than tp kv heads along dim that
    the rank's query heads read; scatter_copies_to_tp_region), "scatter_pieces" (Replicate ->
    the rank's piece under a column linear's layout, ``runs``; scatter_pieces_to_tp_region) or
    "all_reduce" (the Partial output of ``producer``, ``reduce_op`` "sum" | "avg";
    reduce_partial_from_tp). ``producer``: node name of the value; ``readers``: the nodes
    that read it so (all of its readers for an all_reduce). ``bytes``: what one rank sends
    per forward + backward at the example's shapes (ring collectives: an all-gather moves
    (tp - 1) / tp of the whole value, an all-reduce twice that). ``why``: the op and source
    line that needed it. ``inner``: for an all_gather of a (outer, inner) merged dim whose
    inner factor is sharded (a (batch, heads) merge), the inner factor's global size; 0
    for a plain Shard. ``runs``: for a scatter_pieces, per tp rank the ``(full_offset,
    length)`` ranges along ``dim`` that make its piece, in order (plan/layouts.py segments)."""
    kind: str
    producer: str
    readers: tuple
    dim: Optional[int] = None
    inner: int = 0
    reduce_op: Optional[str] = None
    bytes: int = 0
    why: str = ""
    runs: tuple = ()


@dataclass
class TPDecision:
    """Column/row weight FQNs (get_attr targets), the shape-constant rewrites and the
    report. ``biases`` maps a linear's bias FQN to its weight FQN (a weight read in pieces,
    each with its own bias, has several: ``F.linear(x, w[:d], q_bias)``, ``F.linear(x,
    w[2 * d:], v_bias)``); ``dims`` maps every sharded weight and column bias to its sharded
    dim (``tp_dim``), ``layouts`` those with a layout other than the even split to it (a
    :mod:`parallelizer.plan.layouts` class)."""

    column: set = field(default_factory=set)
    row: set = field(default_factory=set)
    biases: dict = field(default_factory=dict)
    tp: int = 1  # the degree planned for
    linears: list = field(default_factory=list)  # weight FQN of every linear, in graph order
    dims: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # also printed by the CLI
    blockers: list = field(default_factory=list)  # "op at file:line in module: reason", in order
    # why no linear is sharded, when plan_tp leaves it to vocab_parallel to decide whether
    # tp shards anything (planning/tp.py check_sharded); "" otherwise
    unsharded: str = ""
    per_head: dict = field(default_factory=dict)  # per-head parameter fqn -> its heads dim
    # a buffer multiplied into a sharded weight at its shape (a pruning mask) -> that weight
    masks: dict = field(default_factory=dict)
    # node name -> dim: a replicated per-head value (ALiBi slopes) each rank cuts to its block
    # of heads (runtime/tp.py scatter_to_tp_region), inserted after that node
    narrows: dict = field(default_factory=dict)
    # size node rewritten to its local value -> the ops on replicated values it also sizes,
    # which read a copy keeping the global value (analysis/sharding/strided.py check_sizes)
    size_copies: dict = field(default_factory=dict)
    # Redistribution, in graph order of the producers
    redistributions: list = field(default_factory=list)
    # node name -> placement of the settled propagation (analysis/sharding/placements.py:
    # Replicate() | Shard(dim) | PerOutput of them); empty at tp=1
    placements: dict = field(default_factory=dict)
    # weight fqn of a linear left replicated -> its report lines (vocab_parallel may shard
    # it as an LM head: planning/vocab.py tp_report leaves those lines out)
    replicated: dict = field(default_factory=dict)
    # fqn of a parameter of 2+ dims no linear reads (an einsum's projection, a convolution's
    # kernel, a heads-mixing matrix), left whole -> its report line (planning/tp_matrices.py
    # other_matrices): counted among the replicated matrices by linear_counts
    other_replicated: dict = field(default_factory=dict)
    # derived gradient placements (planning/gradients.py, analysis/gradients.py):
    # replicated activation (node name) -> the sharded-compute nodes reading it that get an
    # f on that edge (beyond the column linears' inputs), in graph order
    f_edges: dict = field(default_factory=dict)
    # replicated parameter fqn -> "op (node) at file:line in module" that makes its gradient
    # Partial over tp: summed over the tp ranks once per step (plan.grad_sync "partial_tp")
    partial: dict = field(default_factory=dict)
    # the greatest common divisor of the sizes the sharded groups split (heads, features,
    # channel groups; kv heads that may be copied left out): every tp that shards them all
    # divides it. The advisor's heads count for a model file without a config
    divides: int = 1


@dataclass
class VocabDecision:
    """vocab_parallel (planning/vocab.py): the vocabulary tables and LM heads sharded over tp,
    read by the vocab_parallel pass and the plan.

    ``vocab``: every sharded name (each name of a tied table, head weights and biases) ->
    vocabulary rows, each ``Shard(0)`` (``dims``) with its layout (``padded``) in ``layouts``;
    ``heads``: the LM head weight fqns; ``tables``: the embedding tables'; ``outputs``: flat model-output index -> vocabulary of
    the logits handed to loss_fn sharded (Shard(-1)) instead of gathered in the graph;
    ``losses``: node name of an aten.cross_entropy_loss over the head's logits -> vocabulary,
    computed vocab-parallel (runtime/vocab_loss.py), the logits never gathered for it;
    ``report``: its report.md lines; ``off``: the line saying why it is off (None when on,
    or at tp = 1)."""

    vocab: dict = field(default_factory=dict)
    heads: set = field(default_factory=set)
    tables: set = field(default_factory=set)
    outputs: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    off: Optional[str] = None

    @property
    def dims(self) -> dict:
        """Sharded name -> its ``tp_dim`` (0: the vocabulary rows)."""
        return dict.fromkeys(self.vocab, 0)


@dataclass(frozen=True)
class PipelineDecision:
    blocks: tuple[str, ...]          # block FQNs in execution order
    stage_of_block: tuple[int, ...]  # stage index per block (of its first part, if cut)
    stage_costs: tuple[int, ...]     # cost per stage (the numbers given to plan_pipeline)
    source: str = "balanced"         # "balanced", or the spec key that fixed the split
    # (child FQN, stage) of every part of each block cut across stages, in order
    part_stages: tuple[tuple[str, int], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_costs)

    def stage_of_unit(self, unit: int, child: Optional[str] = None) -> int:
        """The one map from cost-model units to stages (split_stages, the plan's tensor
        stages, ``reshard --pp`` and the cost summary all call it). Units: 0 before the
        blocks (stage 0), ``1 + i`` for block ``i``, ``len(blocks) + 1`` after the last
        (last stage); ``child``: the direct child of a block whose run a node belongs to,
        which decides the stage when that block is cut across stages."""
        part = self.stage_of_part(child)
        if part is not None:
            return part
        if unit == 0:
            return 0
        if unit > len(self.blocks):
            return self.num_stages - 1
        return self.stage_of_block[unit - 1]

    def stage_of_part(self, child: Optional[str]) -> Optional[int]:
        """The stage of a part (direct child FQN) of a block cut across stages, else None."""
        return next((s for c, s in self.part_stages if c == child), None) if child else None

    def is_cut(self, unit: int) -> bool:
        """Whether block unit ``unit`` is cut across stages (its parts decide)."""
        return 1 <= unit <= len(self.blocks) and len(self.stages_of_block(unit - 1)) > 1

    def block_range(self, stage: int) -> range:
        """Indices of the blocks ``stage`` holds, whole or in part (empty for a last stage
        holding only the head)."""
        idx = [i for i in range(len(self.blocks)) if stage in self.stages_of_block(i)]
        return range(idx[0], idx[-1] + 1) if idx else range(len(self.blocks), len(self.blocks))

    def stages_of_block(self, i: int) -> tuple[int, ...]:
        """Stages holding a part of block ``i`` (one, unless it is cut)."""
        mine = sorted({s for c, s in self.part_stages if _block_of_child(c) == self.blocks[i]})
        return tuple(mine) or (self.stage_of_block[i],)

    def children(self, stage: int) -> dict[str, list[str]]:
        """block FQN -> the children of it ``stage`` holds, for blocks cut across stages."""
        out: dict = {}
        for c, s in self.part_stages:
            if s == stage:
                out.setdefault(_block_of_child(c), []).append(c)
        return out


def _block_of_child(child: str) -> str:
    return child.rsplit(".", 1)[0]


@dataclass
class SequenceParallelDecision:
    """Where the sequence-parallel regions are (Korthikanti et al. 2022, §4.2.2), by node
    name of the graph the ``sequence_parallel`` pass rewrites (after tensor_parallel,
    untie and rng_streams). A sequence placement is ``(dim, flat)``: the value holds its
    sequence on ``dim``, or (``flat``) batch and sequence flattened into ``dim``.

    ``region``: node -> placement of every value held as a sequence shard; ``reduce_scatter``
    / ``all_gather``: the g / f nodes that become reduce-scatter / all-gather; ``splits``:
    replicated value -> placement it enters the region with (local slice); ``exits``: region
    value -> the outside nodes that read it (all-gathered for them); ``param_inputs``: (region
    node, input) edges carrying a parameter broadcast over the sequence (its gradient is
    partial over tp: an f sums it); ``views``: node -> positions ``(arg, index)`` of the
    global sequence length in its sizes (replaced by the local one); ``seq``: (placeholder,
    dim) holding the global sequence length, or an int when static; ``blocks``: the model's
    blocks (module FQNs): an all-gather fused with the linears reading it is fused per block,
    never across two (split_blocks outlines each block, split_stages cuts between them)."""

    enabled: bool = False
    tp: int = 1
    region: dict = field(default_factory=dict)
    reduce_scatter: dict = field(default_factory=dict)
    all_gather: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    exits: dict = field(default_factory=dict)
    param_inputs: list = field(default_factory=list)
    views: dict = field(default_factory=dict)
    dropouts: dict = field(default_factory=dict)
    seq: object = None
    report: list = field(default_factory=list)
    blocker: Optional[str] = None
    blocks: tuple = ()


@dataclass
class EPDecision:
    """Expert parallelism and tensor parallelism inside the experts (planning/experts.py),
    read by the expert_parallel pass and the plan.

    ``ep``: ranks each layer's experts are split over (1: off). ``layers``: one per expert
    layer the pass rewrites (every layer at ep > 1; at ep = 1 those split over tp),
    ``{"module", "experts", "weights", "offsets", "inputs", "outputs", "matmuls", "region",
    "router", "tp", "split_rows"}``, node names of the captured graph (analysis/experts.py
    ExpertLayer); ``"tp"``: whether the layer's FFN dim is split over tp (an f on each row
    tensor entering its region but the ``split_rows``, a bias's rows already split, a g on
    each leaving it). ``tp``: the tp degree planned for. ``dims``: expert
    weight fqn -> its FFN dim (``tp_dim``) for the layers split over tp; ``layouts``: fqn ->
    its :class:`~parallelizer.plan.layouts.Fused` layout (a gate | up weight; absent: the
    even split); ``rewrites``: node name -> ``[(arg index, list index or None, local size)]``
    of the explicit FFN sizes in the regions (the tensor_parallel pass's format).
    ``report``: report.md lines."""

    ep: int = 1
    layers: list = field(default_factory=list)
    report: list = field(default_factory=list)
    tp: int = 1
    dims: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)

    @property
    def weights(self) -> set:
        return {w for layer in self.layers for w in layer["weights"]}


@dataclass(frozen=True)
class TokenMeanDecision:
    """Quotients over a count the inputs decide (planning/token_mean.py), divided by the
    whole step's count instead of each chunk's (passes/token_mean.py, runtime/token_mean.py).

    ``sites``: one dict per quotient, in graph order: {"node": node name of the mean-reduced
    loss or the ``aten.div``, "kind": "loss" | "div", "count": the target / divisor node,
    "ignore_index", "line"}; ``counter``: Python source (torch.fx code generation) of
    ``forward(self, *model inputs in plan.input_names order)`` returning each site's count on
    a chunk (an integer or floating 0-dim tensor); ``exact``: every 0-dim floating output is a
    constant combination of the sites, so the program's loss is the whole batch's."""

    sites: tuple = ()
    counter: str = ""
    exact: bool = False
