"""torchrun entry of test_schedules_equivalence.py: ``--verify`` of one compiled program under several
pipeline schedules in turn, in one process group (a torchrun launch costs seconds on CI).

    torchrun --nproc-per-node N schedules_entry.py OUT [--profile] [--bad-batch] gpipe 1f1b ...
        [--program OUT2 interleaved_1f1b ...]

For each schedule: the stages are rebuilt from OUT/checkpoint (fresh weights), placed as the
schedule needs (plan.schedules.with_schedule), and run_verify prints its report; rank 0
then prints ``SCHEDULE <name> <exit code>``. ``--profile``: then the ``BUBBLE`` line of every
rank (runtime/bubble.py, what ``run.py --profile`` prints). ``--bad-batch``: then a step on a
batch of microbatches + 1 rows, printing ``BATCHERROR <message>`` (rank 0). ``--program
OUT2``: the schedules after it run OUT2 (compiled for the same mesh), in the same group.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parallelizer.errors import BatchError
from parallelizer.plan.schedules import with_schedule
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.setup import init
from parallelizer.runtime.batching import to_batch
from parallelizer.runtime.bubble import run_profile
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.verify import run_verify


def _runs(out: Path, args: list[str]) -> list[tuple[Path, str]]:
    """(program, schedule) pairs in order; ``--program OUT2`` switches the program."""
    runs, it = [], iter(args)
    for a in it:
        if a == "--program":
            out = Path(next(it))
        elif not a.startswith("--"):
            runs.append((out, a))
    return runs


def main(out: Path, args: list[str]) -> int:
    ctx, worst, loaded = None, 0, {}
    for out, name in _runs(out, args):
        if out not in loaded:
            plan = ParallelPlan.from_json((out / "plan.json").read_text())
            loaded[out] = (plan, plan.settings,
                           load_model_module(out).loss_fn)
        plan, spec, loss_fn = loaded[out]
        ctx = ctx or init(plan, "cpu")
        p = with_schedule(plan, name)
        stages = build_stages(out, p, ctx)
        code = run_verify(out, p, spec, stages, ctx, loss_fn)
        if ctx.rank == 0:
            print(f"SCHEDULE {name} {code}", flush=True)
        worst = max(worst, code)
        if "--profile" in args:
            run_profile(out, p, spec, stages, ctx, loss_fn, None)
        if "--bad-batch" in args:
            _bad_batch(p, stages, ctx, loss_fn)
    dist.barrier()
    dist.destroy_process_group()
    return worst


def _bad_batch(plan, stages, ctx, loss_fn) -> None:
    """A step on a batch that does not split into the microbatches must fail before the
    schedule runs, on every rank alike (no rank left waiting in a collective)."""
    n = plan.microbatches + 1
    batch = to_batch(plan, [torch.zeros(n, 4, dtype=torch.long) for _ in plan.input_names])
    try:
        StepRunner(stages, plan, ctx, loss_fn).step(batch)
    except BatchError as e:
        if ctx.rank == 0:
            print(f"BATCHERROR {e}", flush=True)


if __name__ == "__main__":
    code = main(Path(sys.argv[1]), sys.argv[2:])
    sys.stdout.flush()
    os._exit(code)
