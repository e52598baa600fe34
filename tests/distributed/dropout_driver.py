"""torchrun driver of test_dropout_training.py: dropout on the model-parallel streams of a compiled
program with tp > 1, in one launch, with the functions run.py calls (build_stages,
run_train, save_checkpoint, run_verify).

    torchrun --nproc-per-node N dropout_driver.py OUT STEPS CKPT

1. ``run_train`` STEPS steps with a forward hook on every emitted block (their outputs are
   the residual stream, replicated over tp): per step the tp ranks' block outputs must be
   bit-identical, and so must the replicated parameters after the last step.
2. Control: the replicated stream seeded per tp rank for one more step must break that.
3. Fresh streams (as a new process's ``init``) and stages: 2 steps, ``save_checkpoint``;
   again fresh, ``run_train(resume=CKPT)`` for 2 steps: their losses are those of steps
   3 and 4 of run 1. These stages checkpoint every block's activations: the recompute in
   backward (and in torch's shape inference) must draw the forward's masks again.
4. ``run_verify`` on fresh stages (dropout inactive in the program and the reference).

Rank 0 prints ``RESULT {json}``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime import rng
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.loop import run_train
from parallelizer.runtime.train import save_checkpoint
from parallelizer.runtime.verify import run_verify


def _capture(stages) -> list:
    seen = []
    for _, block in stages.emitted_blocks():
        block.register_forward_hook(lambda m, i, out: seen.extend(
            t.detach().clone() for t in (out if isinstance(out, tuple) else (out,))
            if isinstance(t, torch.Tensor)))
    return seen


def _tp_mismatches(tensors: list, ctx) -> int:
    """Values (of ``tensors``, flattened) that differ between this rank and tp rank 0."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size(ctx.group("tp")))]
    dist.all_gather(got, flat, group=ctx.group("tp"))
    return int((got[0] != flat).sum())


def _total(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def _fresh_streams(plan, ctx, salt: int = 0) -> None:
    rng.seed_streams(plan.seed + salt, ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, plan.mesh["tp"])


def main(out: Path, steps: int, ckpt: Path) -> None:
    plan = ParallelPlan.from_json((out / "plan.json").read_text())
    spec = plan.settings
    module = load_model_module(out)
    ctx = init(plan, "cpu")
    result = {}

    stages = build_stages(out, plan, ctx)
    seen = _capture(stages)
    losses, _, _ = run_train(plan, spec, stages, ctx, module.loss_fn, module, steps)
    result["losses"] = losses
    result["block_outputs"] = _total(len(seen))
    result["activation_mismatches"] = _total(_tp_mismatches(seen, ctx))
    replicated = [p.detach() for name, p in stages.named_parameters()
                  if plan.tensors[plan.aliases.get(name, name)].tp_dim is None]
    result["replicated_parameters"] = _total(len(replicated))
    result["parameter_mismatches"] = _total(_tp_mismatches(replicated, ctx))

    seen.clear()
    _fresh_streams(plan, ctx, salt=1 + ctx.tp_rank)  # control: replicated masks per tp rank
    batch = next(iter(module.batches()))
    StepRunner(stages, plan, ctx, module.loss_fn).step(batch)
    result["control_mismatches"] = _total(_tp_mismatches(seen, ctx))

    _fresh_streams(plan, ctx)
    ac = plan.with_activation_checkpointing("full")
    half = build_stages(out, ac, ctx)
    first, opt, step = run_train(ac, spec, half, ctx, module.loss_fn, module, 2)
    save_checkpoint(half, ac, ctx, ckpt, opt, step, spec["optimizer"]["name"])
    _fresh_streams(plan, ctx)
    resumed = build_stages(out, ac, ctx, ckpt)
    second, _, _ = run_train(ac, spec, resumed, ctx, module.loss_fn, module, 4, resume=ckpt)
    result["save_resume_losses"] = first + second

    _fresh_streams(plan, ctx)
    result["verify_exit"] = run_verify(out, plan, spec, build_stages(out, plan, ctx), ctx,
                                       module.loss_fn)
    if ctx.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)  # as run.py: gloo's threads at interpreter teardown aborted runs
