"""``run.py --train --steps N [--save DIR]``: train on ``batches()`` from model.py (seeded
synthetic batches shaped like the example inputs when it has none) and save the trained
weights in the same sharded layout."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..checkpoint.writer import write_checkpoint
from ..plan import ParallelPlan
from .batching import dp_slice, synthetic_batches
from .gather import full_tensor
from .optim import make_optimizer
from .setup import RankContext
from .step import StepRunner


def run_train(plan: ParallelPlan, spec: dict, stage, ctx: RankContext, loss_fn, model_module,
              example, steps: int) -> list[float]:
    ocfg = spec["optimizer"]
    runner = StepRunner(stage, plan, ctx, loss_fn)
    opt = make_optimizer(stage.parameters(), ocfg["name"], ocfg["lr"], ocfg["weight_decay"])
    source = model_module.batches() if hasattr(model_module, "batches") else \
        synthetic_batches(plan, example, plan.seed)
    losses = []
    for step, batch in zip(range(steps), source):
        opt.zero_grad(set_to_none=True)
        loss, _ = runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
        losses.append(loss.item())
        if ctx.rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    return losses


def save_checkpoint(stage, plan: ParallelPlan, ctx: RankContext, out: Path) -> None:
    """Gather every tensor to full shape and write ``out`` atomically from global rank 0
    (via ``write_checkpoint``: temporary folder, then rename). Memory on rank 0 is the whole
    model; the streaming per-rank writer comes with the checkpoint issue."""
    tp = plan.mesh["tp"]
    mine = {}
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        fqn = plan.aliases.get(name, name)
        full = full_tensor(t, plan.tensors[fqn], ctx, tp).cpu()
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            mine[fqn] = full
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank == 0:
        state = {}
        for part in gathered:
            state.update(part)
        write_checkpoint(state, plan, Path(out), overwrite=True)
        print(f"saved {len(state)} tensors to {out}", flush=True)
    dist.barrier()
