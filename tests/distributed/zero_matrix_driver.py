"""torchrun driver of test_zero_matrix.py: every ZeRO stage x activation checkpointing on
compiled programs, in one launch (one process group; a new device mesh per program).

    torchrun --nproc-per-node 4 zero_matrix_driver.py OUT [OUT ...]

Per OUT (compiled with SGD lr 0.1) and case of :func:`cases`: build
the rank's stages with the real runtime (stage_builder.build_stages, StepRunner,
make_stage_optimizer), train 3 steps, gather the last step's gradients and the final
parameters to full shape, and compare them on rank 0 with 3 eager steps of the unmodified
model; or ``run_verify`` under bf16 mixed precision; or one AdamW step, runtime/memory.measure on every rank
against advisor.memory.estimate_program for that rank. Prints ``RESULT {json}`` lines.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from parallelizer.advisor.memory import estimate_program
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice, synthetic_batches
from parallelizer.runtime.data_parallel import make_stage_optimizer
from parallelizer.runtime.gather import full_tensor
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.memory import measure
from parallelizer.runtime.optim import make_optimizer
from parallelizer.runtime.setup import init
from parallelizer.plan.schedules import V_SHAPED, with_schedule
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.tp import set_tp_group

T0 = time.perf_counter()
STEPS = 3
LR = 0.1


def batches(plan, module):
    if hasattr(module, "batches"):
        return list(itertools.islice(module.batches(), STEPS))
    return list(itertools.islice(synthetic_batches(plan, module.example_inputs(), plan.seed), STEPS))


def eager(module, data):
    """3 SGD steps of the unmodified model: (last step's grads, final params), by name."""
    model = module.build_model()
    model.train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    opt = make_optimizer(model.parameters(), "sgd", LR, 0.0)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        out = model(**batch) if isinstance(batch, dict) else model(*batch)
        module.loss_fn(out, batch).backward()
        opt.step()
    named = dict(model.named_parameters(remove_duplicate=False))
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in named.items())
    return ({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None},
            {n: p.detach().clone() for n, p in named.items()}, moved)


def gather(stage, plan, ctx, pick) -> dict | None:
    """``pick(param)`` at full shape under its canonical fqn, on rank 0. Collective."""
    mine = {}
    for name, p in stage.named_parameters():
        fqn = plan.aliases.get(name, name)
        t = pick(p)
        if t is None:
            continue
        full = full_tensor(t, plan.tensors[fqn], ctx, plan.mesh["tp"]).cpu()
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            mine[fqn] = full
    parts = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return None if ctx.rank != 0 else {k: v for part in parts for k, v in part.items()}


def build(out, plan, module):
    """This rank's stages (two under V placement) from OUT/checkpoint, and their runner."""
    set_tp_group(None)  # the previous program's tp group must not leak into this one
    ctx = init(plan, "cpu")
    stages = build_stages(out, plan, ctx)
    return ctx, stages, StepRunner(stages, plan, ctx, module.loss_fn)


def train_case(out, plan, module, data, want):
    ctx, stage, runner = build(out, plan, module)
    opt = make_stage_optimizer(stage.parameters(), "sgd", LR, 0.0, plan.zero_stage, ctx)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        grads = gather(stage, plan, ctx, lambda p: p.grad)  # the last step's, before its update
        opt.step()
    params = gather(stage, plan, ctx, lambda p: p)
    prefetch = [[len(b._get_fsdp_state()._states_to_forward_prefetch),
                 len(b._get_fsdp_state()._states_to_backward_prefetch)]
                for _, b in stage.emitted_blocks()] if plan.zero_stage >= 2 else []
    if ctx.rank != 0:
        return
    want_grads, want_params, moved = want
    err = {"gradients": 0.0, "parameters": 0.0}
    counts = {"gradients": 0, "parameters": 0}
    for cat, got, ref in (("gradients", grads, want_grads), ("parameters", params, want_params)):
        missing = {plan.aliases.get(n, n) for n in ref} ^ set(got)
        assert not missing, (plan.schedule, plan.zero_stage, cat, sorted(missing))
        for name, w in ref.items():
            fqn = plan.aliases.get(name, name)
            g = got[fqn]
            assert g.shape == w.shape, (name, g.shape, w.shape)
            err[cat] = max(err[cat], (g - w).abs().max().item())
            counts[cat] += 1
    report({"kind": "train", "out": out.name, "schedule": plan.schedule, "zero_stage": plan.zero_stage,
            "ac": plan.activation_checkpointing, "offload": plan.offload,
            "dp_replicate": plan.dp_replicate, "mesh": plan.mesh, "err": err, "counts": counts, "moved": moved,
            "prefetch": prefetch})


def memory_case(out, plan, module, data, sources):
    ctx, stage, runner = build(out, plan, module)
    opt = make_stage_optimizer(stage.parameters(), "adamw", 1e-3, 0.0, plan.zero_stage, ctx)
    opt.zero_grad(set_to_none=True)
    runner.step(dp_slice(plan, data[0], ctx.dp_rank, ctx.device))
    opt.step()
    got = measure(stage, opt, ctx)
    rows = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(got, rows, dst=0)
    if ctx.rank == 0:  # the estimate of every rank, computed once
        est = estimate_program(plan, sources, module.example_inputs(), module.loss_fn, "adamw")
        report({"kind": "memory", "out": out.name, "zero_stage": plan.zero_stage,
                "dp_replicate": plan.dp_replicate, "schedule": plan.schedule,
                "virtual_stages": plan.virtual_stages,
                "ranks": [{"measured": m, "estimated": dataclasses.asdict(e)} for m, e in zip(rows, est)]})


def verify_case(out, plan, module):
    """``run.py --verify``'s own function on a mixed-precision variant of the program."""
    from parallelizer.runtime.verify import run_verify
    ctx, stage, _ = build(out, plan, module)
    spec = plan.settings
    code = run_verify(out, plan, spec, stage, ctx, module.loss_fn)
    if ctx.rank == 0:
        report({"kind": "verify", "out": out.name, "param_dtype": plan.param_dtype, "code": code})


def report(obj):
    obj["seconds"] = round(time.perf_counter() - T0, 1)
    print("RESULT " + json.dumps(obj), flush=True)


def cases(base: ParallelPlan) -> list[tuple]:
    """(check, zero_stage, activation checkpointing, dp_replicate, offload[, schedule]).
    Training runs cover every (zero stage, mesh) pair and every (zero stage, checkpointing)
    pair over the programs (a pairwise design: the full product took 60 s on 2 cores);
    memory runs every zero stage on the pp=2 program (uneven stages, tied embedding in both)
    and HSDP. The V program (2 stages per rank) trains under the three zero-bubble
    schedules with FSDP2: their split weight-gradient action under ZeRO-3 once dropped
    gradients (runtime/pipeline_stage.py); its memory runs under V placement (zbv,
    ZeRO-3: both local stages sharded) and loop placement (interleaved_1f1b, ZeRO-1: one
    partition over both local stages' parameters)."""
    if base.schedule in V_SHAPED:
        return [("train", 3, "none", 1, False, "zbv"), ("train", 3, "none", 1, False, "dualpipev"),
                ("train", 2, "full", 1, False, "interleaved_zero_bubble"),
                ("memory", 3, "none", 1, False, "zbv"),
                ("memory", 1, "none", 1, False, "interleaved_1f1b")]
    if base.mesh["tp"] > 1:
        return [("train", 0, "none", 1, False), ("train", 1, "full", 1, False),
                ("train", 2, "none", 1, False), ("train", 3, "full", 1, False),
                ("verify-bf16", 2, "none", 1, False)]
    if base.mesh["pp"] > 1:
        return [("train", 0, "full", 1, False), ("train", 1, "none", 1, False),
                ("train", 2, "full", 1, False), ("train", 3, "none", 1, False)] + \
               [("memory", z, "none", 1, False) for z in range(4)]
    return [("train", 0, "none", 1, False), ("train", 1, "selective", 1, False),
            ("train", 2, "selective", 1, False), ("train", 3, "full", 2, False),
            ("train", 3, "selective", 1, True), ("memory", 3, "none", 2, False)]


def main(outs: list[Path]) -> None:
    dist.init_process_group("gloo")
    for out in outs:
        base = ParallelPlan.from_json((out / "plan.json").read_text())
        if base.schedule in V_SHAPED:  # compiled for dp=1: run it over dp=2 (same checkpoint)
            base = dataclasses.replace(base, mesh={**base.mesh, "dp": 2})
        module = load_model_module(out)
        data = batches(base, module)
        want = eager(module, data) if dist.get_rank() == 0 else None
        sources = {f"program/{p.name}": p.read_text() for p in (out / "program").glob("stage*.py")}
        for check, zero, ac, rep, offload, *schedule in cases(base):
            # HSDP also runs the deepest explicit prefetch (every other block ahead)
            deep = 3 if rep > 1 else 1
            plan = dataclasses.replace(base, zero_stage=zero, dp_replicate=rep, offload=offload,
                                       prefetch_forward=deep, prefetch_backward=deep)
            plan = plan.with_activation_checkpointing(ac, base.checkpoint_every)
            if schedule:
                plan = with_schedule(plan, schedule[0])
            if check == "train":
                train_case(out, plan, module, data, want)
            elif check == "verify-bf16":
                verify_case(out, dataclasses.replace(plan, param_dtype="bf16", reduce_dtype="fp32"), module)
            else:
                memory_case(out, plan, module, data, sources)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
    sys.stdout.flush()
    os._exit(0)
