"""One rank of ``python -m benchmarks.communication``'s gradient-compression rows (torchrun):
the compiled program (dp=2, or dp=4 as HSDP 2 x 2) built as run.py builds it, once per
compression method (the plan's ``compression`` replaced, as the compiler writes it), a few
warm-up steps (PowerSGD's uncompressed warm-up included), then one step recorded by
benchmarks/_comm.py's dispatch mode over c10d ops. Rank 0 writes every rank's records.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch.distributed as dist

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice
from parallelizer.runtime.data_parallel import make_stage_optimizer
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.tp import set_tp_group

from ._comm import CollectiveRecorder

WARMUP = 3  # > PowerSGD's start_iter: the recorded step is compressed
METHODS = {"none": {"method": "none"}, "fp16": {"method": "fp16"}, "bf16": {"method": "bf16"},
           "powersgd": {"method": "powersgd", "rank": 4, "start_iter": 2, "error_feedback": True},
           "topk": {"method": "topk", "ratio": 0.01, "error_feedback": True}}


def run(out: Path, plan: ParallelPlan, module, batches) -> list:
    set_tp_group(None)
    ctx = init(plan, "cpu")
    stages = build_stages(out, plan, ctx)
    runner = StepRunner(stages, plan, ctx, module.loss_fn)
    opt = make_stage_optimizer(stages.parameters(), "sgd", 1e-3, 0.0, plan.zero_stage, ctx)
    for i, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if i < WARMUP:
            runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        else:
            with CollectiveRecorder() as rec:
                runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(rec.records, gathered, dst=0)
    return gathered


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--program", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--hsdp", action="store_true", help="zero_stage 3, dp_replicate 2 (else zero_stage 0)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    base = ParallelPlan.from_json((a.program / "plan.json").read_text())
    base = dataclasses.replace(base, zero_stage=3, dp_replicate=2) if a.hsdp else \
        dataclasses.replace(base, zero_stage=0)
    module = load_model_module(a.program)
    batches = list(itertools.islice(module.batches(), WARMUP + 1))
    result = {}
    for name, settings in METHODS.items():
        plan = dataclasses.replace(base, compression=settings)
        if a.hsdp and name in ("fp16", "bf16"):
            plan = dataclasses.replace(plan, reduce_dtype=name)  # what the compiler plans
        result[name] = run(a.program, plan, module, batches)
    if dist.get_rank() == 0:
        a.result.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
