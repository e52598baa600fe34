"""torchrun entry of test_user_models.py: ``--verify`` of several compiled programs in turn,
in one process group (a torchrun launch costs seconds on CI); the programs may have
different meshes of the same world size.

    torchrun --nproc-per-node N user_models_entry.py OUT1 OUT2 ...

For each program, as run.py does it: import ``plan.imports``, build the stages from
OUT/checkpoint, run_verify; rank 0 then prints ``PROGRAM <folder name> <exit code>``.
"""
import os
import sys
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from parallelizer.runtime.imports import import_modules
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.frontend.model_file import loss_of
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.verify import run_verify


def main(outs: list[Path]) -> int:
    worst = 0
    for out in outs:
        plan = ParallelPlan.from_json((out / "plan.json").read_text())
        spec = OmegaConf.to_container(OmegaConf.load(out / "spec.yaml"))
        module = load_model_module(out)
        assert import_modules(plan.imports) is None
        ctx = init(plan, "cpu")  # a new mesh per program, one process group
        stages = build_stages(out, plan, ctx)
        code = run_verify(out, plan, spec, stages, ctx, loss_of(module))
        if ctx.rank == 0:
            print(f"PROGRAM {out.name} {code}", flush=True)
        worst = max(worst, code)
    dist.barrier()
    dist.destroy_process_group()
    return worst


if __name__ == "__main__":
    code = main([Path(a) for a in sys.argv[1:]])
    sys.stdout.flush()
    os._exit(code)
