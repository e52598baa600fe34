"""Pipeline planner: which blocks go to which stage.

Blocks are the children of the model's largest ``nn.ModuleList`` (``model.layers``,
``encoder.layer``, ``blocks``). Stages are contiguous runs of blocks; stage 0 also holds
what runs before the first block (embeddings) and the last stage what runs after the last
(final norm, LM head, loss). The split minimises the largest stage's parameter count
(contiguous min-max partition by dynamic programming, as in PipeDream's planner,
Narayanan et al. 2019, §3.1), so a heavy embedding or LM head shifts blocks away from its
stage. Cost-model-based balancing comes with the pipeline issue.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import PlanError


@dataclass(frozen=True)
class PipelineDecision:
    blocks: tuple[str, ...]          # block FQNs in execution order
    stage_of_block: tuple[int, ...]  # stage index per block
    stage_params: tuple[int, ...]    # parameter count per stage (tied weights in each)


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


def plan_pipeline(block_params: list[int], pre_params: int, post_params: int,
                  pp: int, blocks: tuple[str, ...]) -> PipelineDecision:
    """Split ``len(block_params)`` blocks into ``pp`` contiguous non-empty stages.

    Args:
        block_params: parameter count of each block, in order.
        pre_params / post_params: parameters used before the first / after the last block.

    Raises:
        PlanError: ``pp`` exceeds the number of blocks.
    """
    n = len(block_params)
    if pp == 1:
        return PipelineDecision(blocks, (0,) * n, (pre_params + sum(block_params) + post_params,))
    if n < pp:
        raise PlanError(f"mesh.pp ({pp}) exceeds the number of blocks ({n}) found in the model "
                        f"({blocks[0].rsplit('.', 1)[0] if blocks else 'no nn.ModuleList'}); "
                        f"use mesh.pp <= {max(n, 1)}")
    prefix = [0]
    for c in block_params:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, k: int) -> int:  # blocks [i, j) as stage k
        return prefix[j] - prefix[i] + (pre_params if k == 0 else 0) + (post_params if k == pp - 1 else 0)

    @lru_cache(maxsize=None)
    def best(i: int, k: int) -> tuple[int, tuple[int, ...]]:
        """Min over splits of blocks [i, n) into stages k..pp-1 of the max stage cost."""
        if k == pp - 1:
            return cost(i, n, k), (n,)
        out = None
        for j in range(i + 1, n - (pp - 1 - k) + 1):
            rest, cuts = best(j, k + 1)
            c = max(cost(i, j, k), rest)
            if out is None or c < out[0]:
                out = (c, (j,) + cuts)
        return out

    _, cuts = best(0, 0)
    stage_of, start = [], 0
    for k, end in enumerate(cuts):
        stage_of += [k] * (end - start)
        start = end
    starts = [0] + list(cuts[:-1])
    costs = tuple(cost(s, e, k) for k, (s, e) in enumerate(zip(starts, cuts)))
    return PipelineDecision(blocks, tuple(stage_of), costs)
