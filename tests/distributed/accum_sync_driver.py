"""torchrun driver of test_train_loop.py's reduction count: under grad_accum the
data-parallel reduction runs once per optimizer step, not once per batch.

    torchrun --nproc-per-node 2 accum_sync_driver.py OUT [OUT ...]

Per OUT (a dp=2, pp=1 program): one step of 1 microbatch and one of 4 (grad_accum 4) through
the real runtime, each under torch.profiler; the gloo collectives the profiler records
(``c10d::allreduce_`` for DDP, ``c10d::_reduce_scatter_base_`` / ``reduce_scatter`` for
FSDP2) are counted. Prints ``RESULT {json}`` with both counts on rank 0.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from parallelizer.frontend.model_file import load_model_file
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice, synthetic_batches
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.tp import set_tp_group

KINDS = ("allreduce", "reduce_scatter", "_reduce_scatter_base")


def count(out: Path, accum: int) -> dict:
    plan = ParallelPlan.from_json((out / "plan.json").read_text())
    module = load_model_file(out / "model.py")
    set_tp_group(None)
    ctx = init(plan, "cpu")
    stages = build_stages(out, plan, ctx)
    runner = StepRunner(stages, plan, ctx, module.loss_fn, grad_accum=accum)
    batch = next(synthetic_batches(plan, module.example_inputs(), 0))
    local = dp_slice(plan, batch, ctx.dp_rank, ctx.device)
    runner.step(local, keep_outputs=False)  # warm-up: DDP builds its buckets in step 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(local, keep_outputs=False)
    names = [e.name for e in prof.events()]
    return {k: sum(1 for n in names if k in n and n.startswith("c10d::")) for k in KINDS}


def main(outs: list[Path]) -> None:
    for out in outs:
        one, four = count(out, 1), count(out, 4)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"out": str(out), "one": one, "four": four}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
