"""``run.py --train --steps N [--save DIR]``: train on ``batches()`` from model.py (seeded
synthetic batches shaped like the example inputs when it has none) and save the trained
weights in the same sharded layout."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..checkpoint.writer import write_checkpoint
from ..errors import UserError
from ..plan import ParallelPlan
from .batching import dp_slice, synthetic_batches
from .gather import full_tensor
from .data_parallel import make_stage_optimizer
from .setup import RankContext
from .step import StepRunner


def run_train(plan: ParallelPlan, spec: dict, stage, ctx: RankContext, loss_fn, model_module,
              steps: int) -> list[float]:
    """Train ``steps`` steps; returns the losses (global means, on every rank)."""
    ocfg = spec["optimizer"]
    runner = StepRunner(stage, plan, ctx, loss_fn)
    opt = make_stage_optimizer(stage.parameters(), ocfg["name"], ocfg["lr"], ocfg["weight_decay"],
                               plan.zero_stage, ctx)
    source = batch_source(plan, model_module, spec)
    losses = []
    for step, batch in zip(range(steps), source):
        opt.zero_grad(set_to_none=True)
        loss, _ = runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
        losses.append(loss.item())
        if ctx.rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    return losses


def batch_source(plan: ParallelPlan, model_module, spec: dict):
    """model.py's batches(), else seeded synthetic batches shaped like example_inputs()."""
    if model_module is not None and hasattr(model_module, "batches"):
        return model_module.batches()
    if model_module is not None:
        return synthetic_batches(plan, model_module.example_inputs(), plan.seed)
    raise ValueError("--train needs batches: this program has no model.py (compiled from an "
                     "in-memory model); train it through the Python API instead")


def gather_full_state(stage, plan: ParallelPlan, ctx: RankContext) -> dict | None:
    """Every tensor of the model at full shape under its canonical FQN, on global rank 0
    (None elsewhere). Collective over all ranks. Memory on rank 0 is the whole model; the
    streaming per-rank writer comes with the checkpoint issue."""
    tp = plan.mesh["tp"]
    mine = {}
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        fqn = plan.aliases.get(name, name)
        full = full_tensor(t, plan.tensors[fqn], ctx, tp).cpu()
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            mine[fqn] = full
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank != 0:
        return None
    state = {}
    for part in gathered:
        state.update(part)
    return state


def check_save_target(out: Path) -> None:
    """A save may replace an earlier checkpoint (a folder with manifest.json), never other
    files, a compiled program, or the weights a program was compiled with.

    Raises:
        UserError: ``out`` is a file, a program folder (plan.json), an OUT/checkpoint, or a
            non-empty folder that is not a checkpoint.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"--save {out}: a file is in the way; pass a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if (out / "plan.json").exists() or (out.parent / "plan.json").exists():
        raise UserError(f"--save {out}: that is a compiled program or its checkpoint/, which "
                        f"--verify needs; save somewhere else")
    if not (out / "manifest.json").exists():
        raise UserError(f"--save {out}: the folder holds files that are not a parallelizer "
                        f"checkpoint; save into a new or empty folder")


def save_checkpoint(stage, plan: ParallelPlan, ctx: RankContext, out: Path) -> None:
    """Write the model to ``out`` in the plan's sharded layout, atomically (temporary
    folder, then rename) from global rank 0. Collective."""
    check_save_target(Path(out))  # on every rank, before any collective: all raise alike
    state = gather_full_state(stage, plan, ctx)
    if state is not None:
        write_checkpoint(state, plan, Path(out), overwrite=True)
        print(f"saved {len(state)} tensors to {out}", flush=True)
    dist.barrier()
