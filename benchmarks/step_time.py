"""Step time of the emitted program beside the same model parallelized by hand with torch's
native APIs (benchmarks/native_llama.py), on gloo/CPU (or NCCL with ``--device cuda``):
tp=2 x dp=2 (FSDP2, ZeRO-3) and tp=2 x pp=2 (1F1B, 4 microbatches), world 4.

Both run in the same torchrun job, stepped alternately on the same batches with AdamW; the
loss must be equal at every step (benchmarks/_worker.py asserts it). Figure: median step
time over ``--steps`` steps after ``--warmup``; ratio ours / native, target <= 1.0.

``--moe`` (benchmarks/_moe_step.py): a Mixtral at dp2 x ep2 against tp2 (experts
replicated), world 2, CPU: ratio ep2 / tp2 of the median step.

    python -m benchmarks.step_time [--quick] [--device cuda] [--steps N] [--moe]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ._common import (BENCH_MODEL, BenchmarkError, bench_env, base_parser, check_device, compile_program, main_guard,
                      median, mesh_overrides, print_table, run_worker, write_json)

CONFIGS = {"tp2-dp2-fsdp": dict(tp=2, dp=2, pp=1), "tp2-pp2": dict(tp=2, dp=1, pp=2)}
TARGET = 1.0


def measure(name: str, mesh: dict, steps: int, warmup: int, device: str, quick: bool,
            extra: list[str] = ()) -> dict:
    env = bench_env(quick)
    with tempfile.TemporaryDirectory() as tmp:
        out = compile_program(Path(tmp) / "out", mesh_overrides(**mesh), env=env)
        r = run_worker(out, mesh["tp"] * mesh["dp"] * mesh["pp"],
                       ["--steps", str(steps), "--warmup", str(warmup), "--device", device, *extra], env=env)
    ours, base = median(r["times"]["ours"]), median(r["times"]["native"])
    cpu = median(r["cpu_times"]["ours"]) / median(r["cpu_times"]["native"])
    return {"config": name, **r, "median_s": {"ours": ours, "native": base}, "ratio": ours / base,
            "cpu_ratio_rank0": cpu,
            "target": TARGET, "met": ours / base <= TARGET}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "step_time")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 7; quick 3)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--perturb-baseline", type=float, default=0.0, help="(testing) see _worker.py")
    p.add_argument("--moe", action="store_true", help="Mixtral: dp2 x ep2 against tp2 (CPU only)")
    a = p.parse_args()
    if a.moe:
        from ._moe_step import main as moe_main
        if a.device != "cpu":
            raise BenchmarkError("--moe runs on CPU (gloo) only; drop --device cuda")
        return moe_main(a.quick, a.json, a.steps)
    check_device(a.device, 4)
    steps = a.steps or (3 if a.quick else 7)
    extra = ["--perturb-baseline", str(a.perturb_baseline)] if a.perturb_baseline else []
    runs = [measure(n, CONFIGS[n], steps, 1 if a.quick else 2, a.device, a.quick, extra) for n in a.configs]
    rows = [[r["config"], f"{r['device']} ({'nccl' if r['device'] == 'cuda' else 'gloo'})",
             len(r["times"]["ours"]), f"{r['median_s']['ours']:.3f}", f"{r['median_s']['native']:.3f}",
             f"{r['ratio']:.3f}", f"{r['cpu_ratio_rank0']:.3f}", f"<= {TARGET}", "yes" if r["met"] else "NO",
             f"{r['max_loss_diff']:.1e}"] for r in runs]
    table = print_table(f"step_time: emitted program vs torch-native (model {BENCH_MODEL.stem}"
                        f"{', quick' if a.quick else ''})",
                        ["config", "device", "steps", "ours s (median)", "native s (median)",
                         "ours/native", "CPU time ratio (rank 0)", "target", "met", "max loss diff"], rows)
    write_json("step_time", {"quick": a.quick, "runs": runs, "table": table}, a.json)


if __name__ == "__main__":
    main_guard(main)
