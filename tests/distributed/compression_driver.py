"""torchrun driver of test_compression_training.py: gradient compression through the real
runtime (build_stages, StepRunner, run_verify) on compiled programs whose plan gets
``compression`` (and zero_stage / dp_replicate) replaced, as the compiler writes them.

    torchrun --nproc-per-node 2 compression_driver.py converge GPT_DP2
    torchrun --nproc-per-node 4 compression_driver.py GPT_DP2_TP2 LLAMA_DP2_PP2 LLAMA_DP4 TMP

Prints ``RESULT {json}`` lines: ``train`` (per step global losses of AdamW steps: STEPS per
method at dp=2, SHORT at dp=2 x tp=2), ``eager`` (the unmodified model, STEPS steps, rank 0),
``verify`` (run_verify's exit code), ``resume`` (losses and final parameters of an
uninterrupted run and of a run saved and restored half-way, compression state through
runtime/compression.write_state/load_state).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice, synthetic_batches
from parallelizer.runtime.compression import load_state, write_state
from parallelizer.runtime.data_parallel import make_stage_optimizer
from parallelizer.runtime.main import load_model_module
from parallelizer.runtime.optim import make_optimizer
from parallelizer.runtime.setup import init
from parallelizer.runtime.stage_builder import build_stages
from parallelizer.runtime.step import StepRunner
from parallelizer.runtime.tp import set_tp_group
from parallelizer.runtime.verify import run_verify

T0 = time.perf_counter()
STEPS, LR = 50, 3e-3
SHORT = 8  # steps of each method at dp=2 x tp=2 (the resume cases' uninterrupted runs)
METHODS = {"none": {"method": "none"}, "fp16": {"method": "fp16"}, "bf16": {"method": "bf16"},
           "powersgd": {"method": "powersgd", "rank": 2, "start_iter": 10, "error_feedback": True},
           "topk": {"method": "topk", "ratio": 0.1, "error_feedback": True}}


def data(plan, module, n):
    src = module.batches() if hasattr(module, "batches") else \
        synthetic_batches(plan, module.example_inputs(), plan.seed)
    return list(itertools.islice(src, n))


def pattern_batches(module, n, seed=0):
    """Learnable GPT batches: each row counts up from a random token by a random step in
    {1, 2, 3} (mod vocab), so the next token is predictable from two before it (the
    example's own batches() are uniform random tokens, whose loss cannot fall below ln V)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randint(0, module.VOCAB_SIZE, (module.BATCH, 1), generator=gen)
        b = torch.randint(1, 4, (module.BATCH, 1), generator=gen)
        out.append(((a + b * torch.arange(module.SEQ)) % module.VOCAB_SIZE,))
    return out


def build(out, plan, module):
    set_tp_group(None)
    ctx = init(plan, "cpu")
    stages = build_stages(out, plan, ctx)
    return ctx, stages, StepRunner(stages, plan, ctx, module.loss_fn)


def train(out, plan, module, batches, opt_state=None):
    """(losses, ctx, stages, optimizer) after len(batches) AdamW steps."""
    ctx, stages, runner = build(out, plan, module)
    opt = make_stage_optimizer(stages.parameters(), "adamw", LR, 0.0, plan.zero_stage, ctx)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss, _ = runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
        losses.append(loss.item())
    return losses, ctx, stages, opt


def eager(module, batches):
    model = module.build_model()
    opt = make_optimizer(model.parameters(), "adamw", LR, 0.0)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = module.loss_fn(model(*batch) if not isinstance(batch, dict) else model(**batch), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def resume_case(out, plan, module, batches, tmp: Path):
    """Uninterrupted vs saved + restored at half-way (weights and AdamW state in memory,
    compression state through its files); the restored program is built from scratch."""
    full, ctx, stages, _ = train(out, plan, module, batches)
    want = {n: p.detach().clone() for n, p in stages.named_parameters()}
    half = len(batches) // 2
    first, ctx, stages, opt = train(out, plan, module, batches[:half])
    weights = {n: p.detach().clone() for n, p in stages.named_parameters()}
    opt_sd = opt.state_dict()
    tmp.mkdir(parents=True, exist_ok=True)
    name, entry = write_state(ctx.compression, plan, tmp, ctx.rank)
    dist.barrier()
    ctx, stages, runner = build(out, plan, module)
    with torch.no_grad():
        for n, p in stages.named_parameters():
            p.copy_(weights[n])
    opt = make_stage_optimizer(stages.parameters(), "adamw", LR, 0.0, plan.zero_stage, ctx)
    opt.load_state_dict(opt_sd)
    load_state(ctx.compression, plan, tmp, ctx.rank, ctx.device, files={name: entry})
    rest = []
    for batch in batches[half:]:
        opt.zero_grad(set_to_none=True)
        loss, _ = runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
        rest.append(loss.item())
    diff = max((p.detach() - want[n]).abs().max().item() for n, p in stages.named_parameters())
    diff_t = torch.tensor([diff])
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    report({"kind": "resume", "method": plan.compression["method"], "full": full,
            "resumed": first + rest, "param_diff": diff_t.item()})


def verify_case(out, plan, module, tag):
    ctx, stages, _ = build(out, plan, module)
    spec = OmegaConf.to_container(OmegaConf.load(out / "spec.yaml"))
    code = run_verify(out, plan, spec, stages, ctx, module.loss_fn)
    report({"kind": "verify", "case": tag, "code": code})


def report(obj):
    if dist.get_rank() == 0:
        obj["seconds"] = round(time.perf_counter() - T0, 1)
        print("RESULT " + json.dumps(obj), flush=True)


def converge(gpt: Path) -> None:
    """2 ranks: the GPT example at dp=2 under DDP, each method STEPS steps, and eager."""
    dist.init_process_group("gloo")
    base = dataclasses.replace(ParallelPlan.from_json((gpt / "plan.json").read_text()), zero_stage=0)
    module = load_model_module(gpt)
    batches = pattern_batches(module, STEPS)
    if dist.get_rank() == 0:
        report({"kind": "eager", "losses": eager(module, batches)})
    for name, settings in METHODS.items():
        losses, *_ = train(gpt, dataclasses.replace(base, compression=settings), module, batches)
        report({"kind": "train", "case": f"gpt-dp2 zero0 {name}", "method": name, "losses": losses})
    dist.barrier()
    dist.destroy_process_group()


def main(gpt: Path, llama_pp: Path, llama_dp4: Path, tmp: Path) -> None:
    dist.init_process_group("gloo")
    # the GPT example at dp=2 x tp=2 under DDP (the dp group a subgroup, tp-sharded gradients
    # in the buckets): none, fp16, bf16 for SHORT steps; PowerSGD (from step 3) and Top-K in
    # the resume cases' uninterrupted runs
    base = dataclasses.replace(ParallelPlan.from_json((gpt / "plan.json").read_text()), zero_stage=0)
    module = load_model_module(gpt)
    batches = pattern_batches(module, SHORT)
    for name in ("none", "fp16", "bf16"):
        losses, *_ = train(gpt, dataclasses.replace(base, compression=METHODS[name]), module, batches)
        report({"kind": "train", "case": f"gpt-dp2-tp2 zero0 {name}", "method": name, "losses": losses})
    for name in ("powersgd", "topk"):
        settings = {**METHODS[name], **({"start_iter": 3} if name == "powersgd" else {})}
        resume_case(gpt, dataclasses.replace(base, compression=settings), module, batches,
                    tmp / f"resume-{name}")
    # pp=2 x dp=2, ZeRO-1 (no DDP under a schedule: the hook on one flat bucket)
    base = dataclasses.replace(ParallelPlan.from_json((llama_pp / "plan.json").read_text()), zero_stage=1)
    module = load_model_module(llama_pp)
    verify_case(llama_pp, dataclasses.replace(base, compression=METHODS["topk"]), module, "pp2 zero1 topk")
    # the same pipeline as HSDP with dp_replicate 2 x dp_shard 1 (ZeRO-3): the FSDP2 hook per
    # stage, a tied embedding in both stages
    verify_case(llama_pp, dataclasses.replace(base, zero_stage=3, dp_replicate=2, compression=METHODS["topk"]),
                module, "pp2 hsdp2x1 topk")
    batches = data(base, module, 6)
    for name in ("none", "powersgd"):
        settings = {**METHODS[name], **({"start_iter": 2} if name == "powersgd" else {})}
        losses, *_ = train(llama_pp, dataclasses.replace(base, compression=settings), module, batches)
        report({"kind": "train", "case": f"llama-pp2-dp2 zero1 {name}", "method": name, "losses": losses})
    # HSDP 2 x 2 (ZeRO-3): fp16 as FSDP2's reduce dtype; powersgd/topk on the replicate all-reduce
    base = dataclasses.replace(ParallelPlan.from_json((llama_dp4 / "plan.json").read_text()),
                               zero_stage=3, dp_replicate=2)
    module = load_model_module(llama_dp4)
    verify_case(llama_dp4, dataclasses.replace(base, compression=METHODS["topk"]), module, "hsdp topk")
    verify_case(llama_dp4, dataclasses.replace(base, compression=METHODS["fp16"], reduce_dtype="fp16"),
                module, "hsdp fp16")
    batches = data(base, module, 6)
    for name in ("none", "powersgd", "topk"):
        settings = {**METHODS[name], **({"start_iter": 2} if name == "powersgd" else {})}
        losses, *_ = train(llama_dp4, dataclasses.replace(base, compression=settings), module, batches)
        report({"kind": "train", "case": f"llama-hsdp2x2 zero3 {name}", "method": name, "losses": losses})
    resume_case(llama_dp4, dataclasses.replace(base, compression={**METHODS["powersgd"], "start_iter": 2}),
                module, batches[:4], tmp / "resume-hsdp")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "converge":
        converge(Path(sys.argv[2]))
    else:
        main(*[Path(p) for p in sys.argv[1:5]])
    sys.stdout.flush()
    os._exit(0)
