"""Tokens/s and MFU of the emitted program with ``compile: true`` (each block under
torch.compile, inductor; its CPU backend on this machine) beside the eager program and the
torch-native baseline (benchmarks/native_llama.py), at tp2, dp2 (FSDP2), tp2 x pp2 (1F1B)
and tp2 x dp2, on gloo/CPU (or NCCL with ``--device cuda``).

The three run in one torchrun job, stepped in turn on the same batches with AdamW; the loss
of each must equal the baseline's at every step (benchmarks/_worker.py asserts it). Warm-up
steps (default 3) include the compiled program's first step, which compiles. Figures:
tokens/s = global tokens per step / median step time; MFU = the plan's model FLOPs per token
x tokens/s / (peak x world), the peak a measured fp32 1024^3 matmul per rank (CPU) or the
data-sheet figure (runtime/metrics.py). Ratios are of step times (< 1: faster than native).

    python -m benchmarks.compiled_step [--quick] [--device cuda] [--steps N] [--configs ...]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.metrics import device_peak, plan_flops_per_token

from ._common import (BENCH_MODEL, bench_env, base_parser, check_device, compile_program, main_guard,
                      median, mesh_overrides, print_table, run_worker, write_json)

CONFIGS = {"tp2": dict(tp=2, dp=1, pp=1), "dp2": dict(tp=1, dp=2, pp=1),
           "tp2-pp2": dict(tp=2, dp=1, pp=2), "tp2-dp2": dict(tp=2, dp=2, pp=1)}


def measure(name: str, mesh: dict, steps: int, warmup: int, device: str, quick: bool) -> dict:
    env = bench_env(quick)
    world = mesh["tp"] * mesh["dp"] * mesh["pp"]
    with tempfile.TemporaryDirectory() as tmp:
        eager = compile_program(Path(tmp) / "eager", mesh_overrides(**mesh), env=env)
        comp = compile_program(Path(tmp) / "compiled", [*mesh_overrides(**mesh), "compile=true"], env=env)
        plan = ParallelPlan.from_json((eager / "plan.json").read_text())
        r = run_worker(eager, world, ["--steps", str(steps), "--warmup", str(warmup), "--device", device,
                                      "--compiled", str(comp)], env=env)
    tokens = r["tokens_per_step"]
    example = tokens  # the bench model's batches() have the example's shape
    flops = plan_flops_per_token(plan, example)
    torch.set_num_threads(1)  # a rank's threads (OMP_NUM_THREADS=1 in the workers)
    peak, source = device_peak(torch.device(device), plan.param_dtype, None)
    out = {"config": name, **r, "flops_per_token": flops, "peak_flops": peak, "peak_source": source}
    for side in ("ours", "compiled", "native"):
        t = median(r["times"][side])
        out[side] = {"median_s": t, "tokens_per_s": tokens / t,
                     "mfu": flops * tokens / t / (peak * world)}
    out["eager_vs_native"] = out["ours"]["median_s"] / out["native"]["median_s"]
    out["compiled_vs_native"] = out["compiled"]["median_s"] / out["native"]["median_s"]
    out["compiled_vs_eager"] = out["compiled"]["median_s"] / out["ours"]["median_s"]
    return out


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "compiled_step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 5; quick 2)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    a = p.parse_args()
    check_device(a.device, 4)
    steps = a.steps or (2 if a.quick else 5)
    runs = [measure(n, CONFIGS[n], steps, 2 if a.quick else 3, a.device, a.quick) for n in a.configs]
    rows = [[r["config"], len(r["times"]["ours"]),
             *(f"{r[s]['tokens_per_s']:.0f}" for s in ("native", "ours", "compiled")),
             *(f"{r[s]['mfu']:.2%}" for s in ("native", "ours", "compiled")),
             f"{r['eager_vs_native']:.3f}", f"{r['compiled_vs_native']:.3f}",
             f"{r['compiled_vs_eager']:.3f}", f"{r['max_loss_diff']:.1e}"] for r in runs]
    table = print_table(
        f"compiled_step: compile: true vs eager vs torch-native (model {BENCH_MODEL.stem}"
        f"{', quick' if a.quick else ''}; MFU peak {runs[0]['peak_flops'] / 1e9:.1f} GFLOP/s per rank, "
        f"{runs[0]['peak_source']})",
        ["config", "steps", "native tok/s", "eager tok/s", "compiled tok/s", "native MFU",
         "eager MFU", "compiled MFU", "eager/native time", "compiled/native time",
         "compiled/eager time", "max loss diff"], rows)
    write_json("compiled_step", {"quick": a.quick, "runs": runs, "table": table}, a.json)


if __name__ == "__main__":
    main_guard(main)
