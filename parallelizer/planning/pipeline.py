"""Pipeline planner: which blocks go to which stage, and what each stage costs.

Blocks are the children of the model's largest ``nn.ModuleList`` (``model.layers``,
``encoder.layer``, ``blocks``). Stages are contiguous runs of blocks; stage 0 also holds
what runs before the first block (embeddings) and the last stage what runs after the last
(final norm, LM head); the last stage may hold only that when it is heavy enough.
The split minimises the largest stage's cost, forward + backward
FLOPs from the cost model (``planning/costs.py``): a contiguous min-max partition by
dynamic programming, as in PipeDream's planner (Narayanan et al. 2019, §3.1), so a heavy
LM head shifts blocks away from the last stage. ``pipeline.split_points`` or
``pipeline.layers_per_stage`` in the spec replace the search.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import PlanError
from .costs import PipelineCosts


@dataclass(frozen=True)
class PipelineDecision:
    blocks: tuple[str, ...]          # block FQNs in execution order
    stage_of_block: tuple[int, ...]  # stage index per block
    stage_costs: tuple[int, ...]     # cost per stage (the numbers given to plan_pipeline)
    source: str = "balanced"         # "balanced", or the spec key that fixed the split

    @property
    def num_stages(self) -> int:
        return len(self.stage_costs)

    def block_range(self, stage: int) -> range:
        """Indices of the blocks of ``stage`` (empty for a last stage holding only the head)."""
        idx = [i for i, s in enumerate(self.stage_of_block) if s == stage]
        return range(idx[0], idx[-1] + 1) if idx else range(len(self.blocks), len(self.blocks))


def find_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """FQNs of the children of the ModuleList holding the most parameters ('' if none)."""
    best, best_n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        return ()
    return tuple(f"{best}.{i}" if best else str(i) for i in range(len(model.get_submodule(best))))


def plan_pipeline(block_costs: Sequence[int], pre_cost: int, post_cost: int, num_stages: int,
                  blocks: tuple[str, ...], *, split_points: Optional[Sequence[str]] = None,
                  layers_per_stage: Optional[Sequence[int]] = None,
                  stages_key: str = "mesh.pp") -> PipelineDecision:
    """Split ``len(block_costs)`` blocks into ``num_stages`` contiguous non-empty stages.

    Args:
        block_costs: cost of each block, in order (FLOPs, or any additive measure).
        pre_cost / post_cost: cost before the first / after the last block (stage 0 / last).
        num_stages: stages in the pipeline (``mesh.pp``, times virtual stages per rank).
        split_points: FQNs of the blocks where stages 1.. begin (``pipeline.split_points``).
        layers_per_stage: blocks per stage (``pipeline.layers_per_stage``).
        stages_key: how the spec names ``num_stages``, for error messages.

    Raises:
        PlanError: more stages than blocks; a bad ``split_points`` / ``layers_per_stage``
            (unknown FQN, wrong count, out of order, wrong sum), naming the key and the fix.
    """
    n = len(block_costs)
    if num_stages > 1 and n < num_stages:
        raise PlanError(f"{stages_key} ({num_stages}) exceeds the number of blocks ({n}) found in "
                        f"the model ({blocks[0].rsplit('.', 1)[0] if blocks else 'no nn.ModuleList'}); "
                        f"use {stages_key} <= {max(n, 1)}")
    source = "balanced"
    if split_points is not None:
        sizes, source = _sizes_from_split_points(split_points, blocks, num_stages, stages_key), \
            "pipeline.split_points"
    elif layers_per_stage is not None:
        sizes, source = _check_layers_per_stage(layers_per_stage, n, num_stages, stages_key), \
            "pipeline.layers_per_stage"
    elif num_stages == 1:
        sizes = [n]
    else:
        sizes = _balanced_sizes(list(block_costs), pre_cost, post_cost, num_stages)
    stage_of = tuple(s for s, k in enumerate(sizes) for _ in range(k))
    costs, start = [], 0
    for s, k in enumerate(sizes):
        c = sum(block_costs[start:start + k]) + (pre_cost if s == 0 else 0)
        costs.append(c + (post_cost if s == len(sizes) - 1 else 0))
        start += k
    return PipelineDecision(tuple(blocks), stage_of, tuple(costs), source)


def plan_from_costs(costs: PipelineCosts, num_stages: int, blocks: tuple[str, ...],
                    spec_pipeline=None, stages_key: str = "mesh.pp") -> PipelineDecision:
    """:func:`plan_pipeline` on the cost model's FLOPs, with the spec's overrides, if any."""
    return plan_pipeline([u.flops for u in costs.blocks], costs.units[0].flops,
                         costs.units[-1].flops, num_stages, blocks,
                         split_points=getattr(spec_pipeline, "split_points", None),
                         layers_per_stage=getattr(spec_pipeline, "layers_per_stage", None),
                         stages_key=stages_key)


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


def _min_max_sizes(c: list, pre: int, post: int, k: int) -> list[int]:
    """Blocks per stage minimising the largest stage cost (O(n^2 k) dynamic programming)."""
    n = len(c)
    prefix = [0]
    for x in c:
        prefix.append(prefix[-1] + x)

    def cost(i, j, s):  # blocks [i, j) as stage s
        return prefix[j] - prefix[i] + (pre if s == 0 else 0) + (post if s == k - 1 else 0)

    # best[s][j]: min over splits of blocks [0, j) into stages 0..s of the max stage cost
    best = [[None] * (n + 1) for _ in range(k)]
    arg = [[0] * (n + 1) for _ in range(k)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, k):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(i, j, s))
                if best[s][j] is None or v < best[s][j]:
                    best[s][j], arg[s][j] = v, i
    sizes, j = [], n
    for s in range(k - 1, 0, -1):
        i = arg[s][j]
        sizes.append(j - i)
        j = i
    return [j] + sizes[::-1]


def _sizes_from_split_points(points, blocks, k: int, stages_key: str) -> list[int]:
    """Raises PlanError: wrong count, unknown FQN (with close matches), order, first block."""
    points = list(points)
    if len(points) != k - 1:
        raise PlanError(f"pipeline.split_points has {len(points)} entries {points}, but {k} stages "
                        f"({stages_key}={k}) need {k - 1}: the FQNs of the blocks where stages "
                        f"1..{k - 1} begin")
    index = {b: i for i, b in enumerate(blocks)}
    for p in points:
        if p not in index:
            close = difflib.get_close_matches(p, blocks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            where = f" ({blocks[0]} .. {blocks[-1]})" if blocks else " (the model has none)"
            raise PlanError(f"pipeline.split_points: '{p}' is not a block of the model{hint} "
                            f"A split point is the FQN of a block{where}")
    starts = [index[p] for p in points]
    if starts and starts[0] == 0:
        raise PlanError(f"pipeline.split_points: '{points[0]}' is the first block, so stage 0 would "
                        f"hold no block; list where stages 1..{k - 1} begin")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PlanError(f"pipeline.split_points must be distinct blocks in execution order, got "
                        f"{points}")
    bounds = [0] + starts + [len(blocks)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


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
