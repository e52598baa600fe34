"""Pipeline planner: which blocks (or parts of blocks) go to which stage, and what each
stage costs.

Blocks are the model's repeated layers (``planning/blocks.py``: the children of an
``nn.ModuleList``, a run in an ``nn.Sequential``, or of sibling modules of one class).
Stages are contiguous runs of blocks; stage 0 also holds what runs before the first block
(embeddings) and the last stage what runs after the last (final norm, LM head); the last
stage may hold only that when it is heavy enough.
The split minimises the largest stage's cost, forward + backward
FLOPs from the cost model (``analysis/costs.py``): a contiguous min-max partition by
dynamic programming, as in PipeDream's planner (Narayanan et al. 2019, §3.1), so a heavy
LM head shifts blocks away from the last stage. ``pipeline.split_points`` or
``pipeline.layers_per_stage`` in the spec replace the search.

Cuts inside a block. A block is made of *parts*, the runs of its direct children
(Llama: ``input_layernorm`` + ``self_attn`` + residual add | ``post_attention_layernorm`` +
``mlp`` + residual add). The search may also cut before a part when the cost model offers
that cut (no more activation bytes cross it than cross into the block, so it adds no
pipeline communication; the block's children run one after the other). Policy: the best
whole-block partition is kept unless whole blocks cannot make the requested stages
(stages > blocks) or the finer grid lowers the largest stage cost by more than
``FINER_GAIN`` (1 %): the case of a block bigger than the target stage cost. A block cut
across stages keeps its FQN in each; ``PipelineDecision.part_stages`` says which child runs
where. ``pipeline.split_points`` may name a child (``model.layers.2.mlp``: the stage
begins at that child); ``pipeline.layers_per_stage`` counts whole blocks.
"""
from __future__ import annotations

import difflib
from typing import Optional, Sequence


from ..errors import PlanError
from ..analysis.costs import PipelineCosts
from ..plan.decisions import PipelineDecision
from .blocks import SEARCHED, find_blocks  # noqa: F401  (find_blocks: public here too)


FINER_GAIN = 0.01  # cut inside blocks only when that lowers the largest stage cost by more

# A block's parts: (child FQN, cost, cut offered before it) per run of a direct child, in
# execution order; the first entry's flag is unused. Empty: the block cannot be cut inside.
BlockParts = Sequence[tuple[str, int, bool]]


def _container(blocks: tuple[str, ...]) -> str:
    """Where the blocks sit, for messages: ``model.layers``, or the blocks when they are
    top-level siblings."""
    if not blocks:
        return "no blocks"
    parent = blocks[0].rpartition(".")[0]
    return parent or ", ".join(blocks[:3]) + (", ..." if len(blocks) > 3 else "")




def plan_pipeline(block_costs: Sequence[int], pre_cost: int, post_cost: int, num_stages: int,
                  blocks: tuple[str, ...], *, split_points: Optional[Sequence[str]] = None,
                  layers_per_stage: Optional[Sequence[int]] = None,
                  stages_key: str = "mesh.pp",
                  parts: Optional[Sequence[BlockParts]] = None,
                  calls: Sequence[int] = ()) -> PipelineDecision:
    """Split ``len(block_costs)`` blocks into ``num_stages`` contiguous non-empty stages.

    Args:
        block_costs: cost of each block, in order (FLOPs, or any additive measure).
        pre_cost / post_cost: cost before the first / after the last block (stage 0 / last).
        num_stages: stages in the pipeline (``mesh.pp``, times virtual stages per rank).
        split_points: FQNs of the blocks, or of children of blocks, where stages 1..
            begin (``pipeline.split_points``).
        layers_per_stage: blocks per stage (``pipeline.layers_per_stage``).
        stages_key: how the spec names ``num_stages``, for error messages.
        parts: per block, its parts (:data:`BlockParts`; their costs sum to the block's),
            for cuts inside blocks; None or empty entries: whole blocks only.
        calls: per block, how many times forward runs it (the message names a block run
            several times with the same weights); () when not known.

    Raises:
        PlanError: more stages than blocks and offered cuts inside them; a bad
            ``split_points`` / ``layers_per_stage`` (unknown FQN, wrong count, out of order,
            wrong sum), naming the key, the valid FQNs and the fix.
    """
    n = len(block_costs)
    parts = [list(p) for p in parts] if parts else [[] for _ in range(n)]
    offered = sum(f for p in parts for _, _, f in p[1:])
    if num_stages > 1 and not blocks:
        raise PlanError(f"{stages_key} ({num_stages}): pipeline stages are cut between the "
                        f"model's repeated blocks, and none were found (searched: {SEARCHED}, "
                        f"holding parameters); hold the repeated layers in an nn.ModuleList or "
                        f"nn.Sequential, or use {stages_key}=1")
    if num_stages > 1 and n + offered < num_stages:
        inside = f" and {offered} cut(s) inside blocks" if offered else ""
        raise PlanError(f"{stages_key} ({num_stages}) exceeds the number of blocks ({n}){inside} "
                        f"found in the model ({_container(blocks)}); use {stages_key} <= "
                        f"{max(n + offered, 1)}{repeated_blocks_note(blocks, calls)}")
    if split_points is not None:
        grid = _Grid(block_costs, pre_cost, post_cost, blocks, parts, every_child=True)
        starts = _starts_from_split_points(split_points, grid, num_stages, stages_key)
        return grid.decision(starts, "pipeline.split_points")
    if layers_per_stage is not None:
        sizes = _check_layers_per_stage(layers_per_stage, n, num_stages, stages_key)
        return _whole_blocks(block_costs, pre_cost, post_cost, sizes, blocks,
                             "pipeline.layers_per_stage")
    if num_stages == 1:
        return _whole_blocks(block_costs, pre_cost, post_cost, [n], blocks, "balanced")
    whole = None
    if num_stages <= n:
        sizes = _balanced_sizes(list(block_costs), pre_cost, post_cost, num_stages)
        whole = _whole_blocks(block_costs, pre_cost, post_cost, sizes, blocks, "balanced")
    if offered:
        grid = _Grid(block_costs, pre_cost, post_cost, blocks, parts, every_child=False)
        finer = grid.decision(min_max_starts(grid.costs, num_stages, grid.may_start), "balanced")
        if whole is None or max(finer.stage_costs) < (1 - FINER_GAIN) * max(whole.stage_costs):
            return finer
    return whole


def repeated_calls(blocks: Sequence[str], calls: Sequence[int]) -> list[str]:
    """``"fqn (n times)"`` of each block forward runs more than once (``calls``: the cost
    model's ``block_calls``)."""
    return [f"{b} ({c} times)" for b, c in zip(blocks, calls) if c > 1]


def repeated_blocks_note(blocks: Sequence[str], calls: Sequence[int]) -> str:
    """'' or a sentence naming the blocks forward runs more than once: one module run as
    several layers with the same weights (ALBERT's shared layer) is one block, and stages
    are cut between blocks, not between calls."""
    repeated = repeated_calls(blocks, calls)
    if not repeated:
        return ""
    return (f". Forward runs {', '.join(repeated)} with the same weights: stages are cut "
            f"between modules, not between calls of one module, so those calls stay on one "
            f"stage; a model that shares one layer's weights across its depth (ALBERT) "
            f"pipelines only with one module per layer")


def _whole_blocks(block_costs, pre: int, post: int, sizes: list[int], blocks, source: str):
    stage_of = tuple(s for s, k in enumerate(sizes) for _ in range(k))
    costs, start = [], 0
    for s, k in enumerate(sizes):
        c = sum(block_costs[start:start + k]) + (pre if s == 0 else 0)
        costs.append(c + (post if s == len(sizes) - 1 else 0))
        start += k
    return PipelineDecision(tuple(blocks), stage_of, tuple(costs), source)


def plan_from_costs(costs: PipelineCosts, num_stages: int, blocks: tuple[str, ...],
                    spec_pipeline=None, stages_key: str = "mesh.pp") -> PipelineDecision:
    """:func:`plan_pipeline` on the cost model's FLOPs, with the spec's overrides, if any."""
    return plan_pipeline([u.flops for u in costs.blocks], costs.units[0].flops,
                         costs.units[-1].flops, num_stages, blocks,
                         split_points=getattr(spec_pipeline, "split_points", None),
                         layers_per_stage=getattr(spec_pipeline, "layers_per_stage", None),
                         stages_key=stages_key, parts=costs.block_parts(),
                         calls=costs.block_calls)


class _Grid:
    """The candidate units in execution order: [before], then per block either the block or
    its parts, then [after]; ``may_start[j]``: a stage may begin at unit j. With
    ``every_child`` every part of a block that has parts is a unit (for split_points);
    otherwise parts between cuts that are not offered are merged (for the search)."""

    def __init__(self, block_costs, pre, post, blocks, parts, every_child: bool):
        self.blocks = tuple(blocks)
        self.costs, self.may_start, self.names = [pre], [False], ["<before>"]
        self.block_of, self.children = [-1], [()]   # children: the child FQNs of a unit
        for b, cost in enumerate(block_costs):
            runs = parts[b] if b < len(parts) else []
            if not runs:
                self._add(blocks[b], cost, b, (), b > 0)
                continue
            for j, (child, c, ok) in enumerate(runs):
                if j == 0 or ok or every_child:
                    self._add(child, c, b, (child,), b > 0 or j > 0)
                else:
                    self.costs[-1] += c
                    self.children[-1] += (child,)
        self._add("<after>", post, len(block_costs), (), True)
        self.first_child = {r[0][0]: blocks[b] for b, r in enumerate(parts) if r}

    def _add(self, name, cost, b, children, may_start):
        self.names.append(name)
        self.costs.append(cost)
        self.block_of.append(b)
        self.children.append(children)
        self.may_start.append(may_start)

    def decision(self, starts: list[int], source: str) -> PipelineDecision:
        """The decision for stages 1.. beginning at units ``starts``."""
        stage_of = [sum(1 for s in starts if s <= j) for j in range(len(self.costs))]
        stage_costs = [0] * (len(starts) + 1)
        for j, c in enumerate(self.costs):
            stage_costs[stage_of[j]] += c
        first: list = [None] * len(self.blocks)
        seen: dict = {}
        for j in range(1, len(self.costs) - 1):
            b = self.block_of[j]
            first[b] = stage_of[j] if first[b] is None else first[b]
            seen.setdefault(b, set()).add(stage_of[j])
        parts = tuple((c, stage_of[j]) for j in range(1, len(self.costs) - 1)
                      if len(seen[self.block_of[j]]) > 1 for c in self.children[j])
        return PipelineDecision(self.blocks, tuple(first), tuple(stage_costs), source, parts)


def min_max_starts(costs: Sequence[float], k: int,
                   may_start: Optional[Sequence[bool]] = None) -> list[int]:
    """Units where stages 1..k-1 begin, minimising the largest stage cost over contiguous
    splits of ``costs`` into k non-empty stages beginning only where ``may_start`` (default
    anywhere); O(m^2 k) dynamic programming, ties to the earliest feasible cut. The one
    min-max partitioner: the compiler's balanced stages (whole blocks and cuts inside
    them) and the layout advisor's ``rank_stats``."""
    m = len(costs)
    may_start = [True] * m if may_start is None else may_start
    prefix = [0]
    for x in costs:
        prefix.append(prefix[-1] + x)
    ends = [j for j in range(1, m + 1) if j == m or may_start[j]]
    inf = float("inf")
    # best[s][j]: least max cost of units [0, j) as stages 0..s (j an end)
    best = [dict.fromkeys(ends, inf) for _ in range(k)]
    arg = [dict.fromkeys(ends, 0) for _ in range(k)]
    for j in ends:
        best[0][j] = prefix[j]
    # with costs >= 0, best[s - 1][i] grows with i (past the infeasible first ends): once it
    # reaches best[s][j], no later i can lower it (an exact cut of the search, same ties)
    monotone = all(x >= 0 for x in costs)
    for s in range(1, k):
        prev, row, args = best[s - 1], best[s], arg[s]
        for j in ends:
            pj, b, a = prefix[j], row[j], args[j]
            for i in ends:
                if i >= j:
                    break
                left = prev[i]
                if left == inf:  # fewer ends before i than stages: the first ones only
                    continue
                if monotone and left >= b:
                    break
                v = left if left > pj - prefix[i] else pj - prefix[i]
                if v < b:
                    b, a = v, i
            row[j], args[j] = b, a
    if best[k - 1][m] == inf:
        raise AssertionError(f"no split of {m} units into {k} stages")  # the caller checks counts
    starts, j = [], m
    for s in range(k - 1, 0, -1):
        j = arg[s][j]
        starts.append(j)
    return starts[::-1]


def _balanced_sizes(c: list, pre: int, post: int, k: int) -> list[int]:
    """Blocks per stage minimising the largest stage cost over the candidate cuts: every
    block boundary, and the cut between the last block and what follows it, so that a head
    heavier than a few blocks (Llama-3-8B's LM head is ~2 blocks of FLOPs) may be a stage
    of its own (a last entry 0)."""
    with_blocks = _min_max_sizes(c, pre, post, k)
    best = _max_cost(c, pre, post, with_blocks)
    if k - 1 <= len(c):
        head_alone = _min_max_sizes(c, pre, 0, k - 1) + [0]
        if _max_cost(c, pre, post, head_alone) < best:
            return head_alone
    return with_blocks


def _max_cost(c: list, pre: int, post: int, sizes: list[int]) -> int:
    costs, start = [], 0
    for s, k in enumerate(sizes):
        costs.append(sum(c[start:start + k]) + (pre if s == 0 else 0)
                     + (post if s == len(sizes) - 1 else 0))
        start += k
    return max(costs)


def min_max_ranges(costs: Sequence[float], k: int) -> list[range]:
    """The k contiguous ranges of :func:`min_max_starts` (stages may begin anywhere)."""
    bounds = [0] + min_max_starts(costs, k) + [len(costs)]
    return [range(i, j) for i, j in zip(bounds, bounds[1:])]


def _min_max_sizes(c: list, pre: int, post: int, k: int) -> list[int]:
    """Blocks per stage minimising the largest stage cost: :func:`min_max_ranges` over the
    blocks, with ``pre`` on the first block and ``post`` on the last (they always go to the
    first and last stage)."""
    costs = list(c)
    costs[0] += pre
    costs[-1] += post
    return [len(r) for r in min_max_ranges(costs, k)]


def _starts_from_split_points(points, grid: _Grid, k: int, stages_key: str) -> list[int]:
    """Units where stages 1.. begin. Raises PlanError: wrong count, unknown FQN (with close
    matches and the valid FQNs), order, first block."""
    points = list(points)
    if len(points) != k - 1:
        raise PlanError(f"pipeline.split_points has {len(points)} entries {points}, but {k} stages "
                        f"({stages_key}={k}) need {k - 1}: the FQNs of the blocks (or of children "
                        f"of blocks) where stages 1..{k - 1} begin")
    index = {name: j for j, name in enumerate(grid.names) if 0 < j < len(grid.names) - 1}
    index.update({b: index[c] for c, b in grid.first_child.items()})  # first child = its block
    for p in points:
        if p not in index:
            raise PlanError(f"pipeline.split_points: '{p}' is not a block of the model"
                            f"{_did_you_mean(p, list(index))} {_valid_points(p, grid)}")
    starts = [index[p] for p in points]
    if starts and starts[0] == 1:
        raise PlanError(f"pipeline.split_points: '{points[0]}' is the first block, so stage 0 would "
                        f"hold no block; list where stages 1..{k - 1} begin")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PlanError(f"pipeline.split_points must be distinct blocks in execution order, got "
                        f"{points}")
    return starts


def _did_you_mean(p: str, valid: list) -> str:
    close = difflib.get_close_matches(p, valid, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _valid_points(p: str, grid: _Grid) -> str:
    """The valid split points near ``p``: the block range, and the children of p's block."""
    blocks = grid.blocks
    if not blocks:
        return "A split point is the FQN of a block (the model has none)"
    msg = f"A split point is the FQN of a block ({blocks[0]} .. {blocks[-1]})"
    block = next((b for b in blocks if p.startswith(b + ".")), None)
    if block is None:
        return msg + " or of a direct child of one"
    b = blocks.index(block)
    kids = [c for j, cs in enumerate(grid.children) if grid.block_of[j] == b for c in cs]
    if not kids:
        return msg + (f"; {block} cannot be cut inside (it has one child, or its children's "
                      f"computations interleave)")
    return msg + f" or of a direct child of one; the children of {block}: {', '.join(kids)}"


def _check_layers_per_stage(sizes, n: int, k: int, stages_key: str) -> list[int]:
    """Raises PlanError: wrong count, an entry < 1 (the last may be 0), or a sum other than
    the block count."""
    sizes = list(sizes)
    if len(sizes) != k:
        raise PlanError(f"pipeline.layers_per_stage has {len(sizes)} entries {sizes}, but there are "
                        f"{k} stages ({stages_key}={k}); give one block count per stage")
    if any(s < 1 for s in sizes[:-1]) or sizes[-1] < 0 or (k > 1 and sizes[-2] < 1):
        raise PlanError(f"pipeline.layers_per_stage {sizes}: every stage needs at least one block, "
                        f"except the last, which may be 0 (it then holds only what follows the "
                        f"last block: final norm, LM head)")
    if sum(sizes) != n:
        raise PlanError(f"pipeline.layers_per_stage {sizes} sums to {sum(sizes)}, but the model has "
                        f"{n} blocks; make the entries sum to {n}")
    return sizes
