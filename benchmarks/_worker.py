"""One rank of a benchmark run (started by torchrun from overhead.py, step_time.py,
communication.py): the emitted program (OUT/, built exactly as ``run.py --train`` builds
it) and the baseline in the same processes, stepped alternately on the same global batches
with the same optimizer, so both see the same machine load.

Baseline: the original model's own eager step at world 1; otherwise the model parallelized
by hand with torch's APIs (benchmarks/native_llama.py).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice
from parallelizer.runtime.data_parallel import make_stage_optimizer
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.optim import make_optimizer
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner

from ._comm import CollectiveRecorder
from .native_llama import NativeLlama


def _parser():
    p = argparse.ArgumentParser()
    p.add_argument("--program", type=Path, required=True, help="OUT/ of parallelize")
    p.add_argument("--compiled", type=Path, default=None,
                   help="a second OUT/ of the same spec with compile: true, stepped as a third "
                        "side 'compiled' (benchmarks/compiled_step.py)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (each side)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--comm", action="store_true", help="record the collectives of one step")
    p.add_argument("--rtol", type=float, default=1e-5, help="equal-loss check: |ours - base| <= "
                   "atol + rtol |base| at every step")
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--perturb-baseline", type=float, default=0.0,
                   help="add this to every baseline weight first (the smoke test's proof that "
                        "the equal-loss check fails when the losses differ)")
    p.add_argument("--result", type=Path, required=True, help="JSON written by rank 0")
    return p


class Ours:
    """The emitted program: run.py --train's stage, StepRunner and optimizer."""
    name = "ours"

    def __init__(self, out: Path, plan: ParallelPlan, ctx, spec: dict, loss_fn, name: str = "ours"):
        self.plan, self.ctx, self.name = plan, ctx, name
        self.stage = build_stages(out, plan, ctx)
        self.runner = StepRunner(self.stage, plan, ctx, loss_fn)
        o = spec["optimizer"]
        self.opt = make_stage_optimizer(self.stage.parameters(), o["name"], o["lr"], o["weight_decay"],
                                        plan.zero_stage, ctx)

    def step(self, batch) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss, _ = self.runner.step(dp_slice(self.plan, batch, self.ctx.dp_rank, self.ctx.device))
        self.opt.step()
        return loss

    def global_loss(self, loss):
        return loss


class Baseline:
    """world 1: the original model's eager step; else NativeLlama (same mesh)."""
    name = "native"

    def __init__(self, module, plan: ParallelPlan, ctx, spec: dict, perturb: float):
        self.plan, self.ctx, self.module = plan, ctx, module
        model = module.build_model()
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(perturb)
        m = plan.mesh
        if plan.world_size == 1:
            self.name = "eager"
            self.model, self.native = model.to(ctx.device).train(), None
            params = self.model.parameters()
        else:
            self.native = NativeLlama(model, pp=m["pp"], dp=m["dp"], tp=m["tp"],
                                      microbatches=plan.microbatches, schedule=plan.schedule,
                                      device=ctx.device, loss_fn=self._logits_loss)
            params = self.native.parameters()
        o = spec["optimizer"]
        self.opt = make_optimizer(params, o["name"], o["lr"], o["weight_decay"])

    def _logits_loss(self, logits, ids):
        return self.module.loss_fn(SimpleNamespace(logits=logits), {"input_ids": ids})

    def step(self, batch):
        self.opt.zero_grad(set_to_none=True)
        if self.native is None:
            b = {k: v.to(self.ctx.device) for k, v in batch.items()}
            loss = self.module.loss_fn(self.model(**b), b)
            loss.backward()
        else:
            ids = dp_slice(self.plan, batch, self.ctx.dp_rank, self.ctx.device)["input_ids"]
            loss = self.native.step(ids)
        self.opt.step()
        return loss

    def global_loss(self, loss):
        """Untimed: the last stage's loss, averaged over dp, on every rank (for the check)."""
        if self.plan.world_size == 1:
            return loss.detach()
        t = torch.zeros((), device=self.ctx.device) if loss is None else loss.detach().clone()
        if self.native.pp > 1 and not self.native.is_last:
            t.zero_()
        dist.all_reduce(t)
        return t / (self.plan.mesh["dp"] * self.plan.mesh["tp"])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(side, batch, device):
    """(wall seconds, this process's CPU seconds, global loss) of one step. CPU time is
    beside wall time because the cores are shared: it excludes time spent preempted."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = side.step(batch)
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, float(side.global_loss(loss))


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    plan = ParallelPlan.from_json((args.program / "plan.json").read_text())
    spec = OmegaConf.to_container(OmegaConf.load(args.program / "spec.yaml"))
    module = load_model_module(args.program)
    ctx = init(plan, args.device)
    torch.manual_seed(0)
    sides = [Ours(args.program, plan, ctx, spec, module.loss_fn),
             Baseline(module, plan, ctx, spec, args.perturb_baseline)]
    if args.compiled is not None:  # same mesh, so the same groups; blocks under torch.compile
        cplan = ParallelPlan.from_json((args.compiled / "plan.json").read_text())
        sides.append(Ours(args.compiled, cplan, ctx, spec, module.loss_fn, "compiled"))
    batches = module.batches()
    result = {"mesh": plan.mesh, "microbatches": plan.microbatches, "schedule": plan.schedule,
              "zero_stage": plan.zero_stage, "device": args.device, "warmup": args.warmup,
              "baseline": sides[1].name, "times": {s.name: [] for s in sides},
              "cpu_times": {s.name: [] for s in sides},
              "losses": {s.name: [] for s in sides}, "rtol": args.rtol, "atol": args.atol}
    for i in range(args.warmup + args.steps):
        batch = next(batches)
        result["tokens_per_step"] = batch["input_ids"].numel()
        order = sides if i % 2 == 0 else sides[::-1]  # alternate who goes first
        for side in order:
            dt, cpu, loss = _timed(side, batch, ctx.device)
            result["losses"][side.name].append(loss)
            if i >= args.warmup:
                result["times"][side.name].append(dt)
                result["cpu_times"][side.name].append(cpu)
        _check_losses(result, sides, i)
    if args.comm:
        result["collectives"] = _record(sides, next(batches), ctx)
    if ctx.rank == 0:
        args.result.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _check_losses(result, sides, i) -> None:
    """Both sides must train the same model: equal loss at every step (the same decision on
    every rank, since both losses are global)."""
    b = result["losses"][sides[1].name][i]
    tol = result["atol"] + result["rtol"] * abs(b)
    result["checked_steps"] = result.get("checked_steps", 0) + 1
    for side in sides[:1] + sides[2:]:
        a = result["losses"][side.name][i]
        result["max_loss_diff"] = max(result.get("max_loss_diff", 0.0), abs(a - b))
        if not abs(a - b) <= tol:
            raise AssertionError(f"LOSS MISMATCH at step {i + 1}: {side.name} {a:.8f} vs "
                                 f"{sides[1].name} {b:.8f} (|diff| {abs(a - b):.3g} > tol {tol:.3g})")


def _record(sides, batch, ctx) -> dict:
    """The collectives of one training step of each side, from every rank (on rank 0)."""
    out = {}
    for side in sides:
        _sync(ctx.device)
        with CollectiveRecorder() as rec:
            side.step(batch)
        _sync(ctx.device)
        gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
        dist.gather_object(rec.records, gathered, dst=0)
        out[side.name] = gathered
    return out


if __name__ == "__main__":
    main()
