"""Data parallelism over the dp mesh dim, by ZeRO stage (Rajbhandari et al. 2020, §5):

- 0: DDP (torch's composable ``replicate``, which keeps the original FQNs). Under pipeline
  parallelism DDP's reducer cannot follow several forwards before their backwards (1F1B),
  so there the gradients are averaged over dp after the schedule's step instead
  (:func:`all_reduce_grads`), which is what DDP computes, without the overlap;
- 1: DDP + ``ZeroRedundancyOptimizer`` (optimizer state partitioned over dp);
- 2: FSDP2 ``fully_shard`` per block with ``reshard_after_forward=False`` (gradients and
  optimizer state sharded; parameters stay gathered between forward and backward);
- 3: FSDP2 per block with ``reshard_after_forward=True`` (parameters sharded too).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from .optim import make_optimizer
from .setup import RankContext


def apply_data_parallel(stage: torch.nn.Module, ctx: RankContext, zero_stage: int) -> None:
    """Wrap ``stage`` for data parallelism in place (no-op when dp = 1)."""
    if ctx.mesh["dp"].size() == 1:
        return
    if zero_stage in (0, 1):
        if ctx.mesh["pp"].size() > 1:
            return  # StepRunner averages gradients after the schedule (all_reduce_grads)
        from torch.distributed._composable.replicate import replicate  # imports torch.jit: lazily
        # find_unused_parameters: a weight the loss does not use (BERT's pooler) must not
        # leave DDP's reducer waiting for its gradient
        replicate(stage, process_group=ctx.group("dp"), find_unused_parameters=True)
        return
    dp_mesh = ctx.mesh["dp"]
    reshard = zero_stage == 3
    for _name, block in stage.emitted_blocks():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)


def make_stage_optimizer(params, name: str, lr: float, weight_decay: float, zero_stage: int,
                         ctx: RankContext) -> torch.optim.Optimizer:
    """The spec's optimizer; under ZeRO-1 with dp > 1, partitioned over the dp group."""
    if zero_stage == 1 and ctx.mesh["dp"].size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports torch.jit: lazily
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, process_group=ctx.group("dp"),
                                       lr=lr, weight_decay=weight_decay)
    return make_optimizer(params, name, lr, weight_decay)


def all_reduce_grads(params, ctx: RankContext) -> None:
    """Average gradients over the dp group in one coalesced all-reduce (DDP's result)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=ctx.group("dp"))
    flat /= ctx.mesh["dp"].size()
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
