"""One rank of the mixture-of-experts benchmarks (started by torchrun from _moe_comm.py and
_moe_step.py). Each ``--program NAME=OUT`` is an emitted program built as ``run.py --train``
builds it (benchmarks/_worker.py ``Ours``), with its own mesh on the same ranks (one
``init`` per program: dp2 x ep2 and tp2 are both world 2; the runtime's tp and ep groups are
process-wide, and each program uses only its own).

``--comm``: one program; ``--warmup`` training steps, then one step whose collectives
_comm.py's dispatch mode records on every rank (rank 0 writes them all, with the index of
the recorded batch in ``batches()``). Otherwise: every program stepped on the same global
batches, who goes first alternating, barrier-timed (wall and CPU time), equal losses
asserted at every step (benchmarks/_worker.py ``_check_losses``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.setup import init

from ._comm import CollectiveRecorder
from ._worker import Ours, _check_losses, _sync, _timed


def _parser():
    p = argparse.ArgumentParser()
    p.add_argument("--program", action="append", required=True, metavar="[NAME=]OUT",
                   help="an OUT/ of parallelize (NAME: the folder's name unless given); the last "
                        "is the baseline of the loss check")
    p.add_argument("--steps", type=int, default=5, help="timed steps (each program)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--comm", action="store_true", help="record the collectives of one step")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--result", type=Path, required=True, help="JSON written by rank 0")
    return p


def _sides(programs: list[str]):
    sides = []
    for item in programs:
        name, _, out = item.rpartition("=")
        out = Path(out)
        name = name or out.name
        plan = ParallelPlan.from_json((out / "plan.json").read_text())
        spec = OmegaConf.to_container(OmegaConf.load(out / "spec.yaml"))
        module = load_model_module(out)
        ctx = init(plan, "cpu")  # the process group once; this plan's mesh, tp / ep groups
        torch.manual_seed(0)
        sides.append(Ours(out, plan, ctx, spec, module.loss_fn, name))
    return sides, module


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    sides, module = _sides(args.program)
    batches = module.batches()
    result = {"meshes": {s.name: {**s.plan.mesh, "ep": s.plan.ep} for s in sides},
              "zero_stage": {s.name: s.plan.zero_stage for s in sides},
              "warmup": args.warmup, "baseline": sides[-1].name, "rtol": args.rtol, "atol": args.atol,
              "times": {s.name: [] for s in sides}, "cpu_times": {s.name: [] for s in sides},
              "losses": {s.name: [] for s in sides}}
    steps = args.warmup + (0 if args.comm else args.steps)
    for i in range(steps):
        batch = next(batches)
        result["tokens_per_step"] = batch["input_ids"].numel()
        for side in sides if i % 2 == 0 else sides[::-1]:
            dt, cpu, loss = _timed(side, batch, sides[0].ctx.device)
            result["losses"][side.name].append(loss)
            if i >= args.warmup:
                result["times"][side.name].append(dt)
                result["cpu_times"][side.name].append(cpu)
        if len(sides) > 1:
            _check_losses(result, sides, i)
    if args.comm:
        (side,) = sides
        _sync(side.ctx.device)
        with CollectiveRecorder() as rec:
            side.step(next(batches))
        _sync(side.ctx.device)
        result["recorded_batch"] = steps
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(rec.records, gathered, dst=0)
        result["collectives"] = gathered
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
