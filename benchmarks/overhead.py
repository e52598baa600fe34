"""Overhead of the emitted program at tp = pp = dp = 1: its training step (run.py --train's
stage, StepRunner and optimizer) beside the original model's own eager step (``model(**batch)``,
``loss_fn``, ``backward``), same batches, same AdamW, stepped alternately in one process.
Equal losses at every step are asserted. Target: ours / eager <= 1.05.

Two models: the Llama example itself (examples/llama, a step of milliseconds, where any
per-step Python overhead shows) and the scaled benchmark Llama (benchmarks/models).

    python -m benchmarks.overhead [--quick] [--device cuda] [--steps N]
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ._common import (BENCH_MODEL, BENCH_SPEC, REPO, bench_env, base_parser, check_device,
                      compile_program, main_guard, median, mesh_overrides, print_table, run_worker,
                      write_json)

TARGET = 1.05
MODELS = {"llama-example": (REPO / "examples" / "llama" / "model.py", REPO / "examples" / "llama" / "spec.yaml"),
          "llama-bench": (BENCH_MODEL, BENCH_SPEC)}


def measure(name: str, steps: int, warmup: int, device: str, quick: bool) -> dict:
    model, spec = MODELS[name]
    env = bench_env(quick)
    with tempfile.TemporaryDirectory() as tmp:
        out = compile_program(Path(tmp) / "out", mesh_overrides(), model=model, spec=spec, env=env)
        r = run_worker(out, 1, ["--steps", str(steps), "--warmup", str(warmup), "--device", device], env=env)
    ours, base = median(r["times"]["ours"]), median(r["times"]["eager"])
    cpu = median(r["cpu_times"]["ours"]) / median(r["cpu_times"]["eager"])
    return {"model": name, **r, "median_s": {"ours": ours, "eager": base}, "ratio": ours / base,
            "cpu_ratio": cpu, "target": TARGET, "met": ours / base <= TARGET}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "overhead")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 30 / 10; quick 3)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    a = p.parse_args()
    check_device(a.device, 1)
    runs = []
    for name, default_steps in (("llama-example", 30), ("llama-bench", 10)):
        if name not in a.models:
            continue
        steps = a.steps or (3 if a.quick else default_steps)
        runs.append(measure(name, steps, 1 if a.quick else 3, a.device, a.quick))
    rows = [[r["model"], r["device"], len(r["times"]["ours"]), f"{r['median_s']['ours'] * 1e3:.1f}",
             f"{r['median_s']['eager'] * 1e3:.1f}", f"{r['ratio']:.3f}", f"{r['cpu_ratio']:.3f}", f"<= {TARGET}",
             "yes" if r["met"] else "NO", f"{r['max_loss_diff']:.1e}"] for r in runs]
    table = print_table(f"overhead: emitted program vs eager model, tp=pp=dp=1{' (quick)' if a.quick else ''}",
                        ["model", "device", "steps", "ours ms (median)", "eager ms (median)",
                         "ours/eager", "ours/eager CPU time", "target", "met", "max loss diff"], rows)
    write_json("overhead", {"quick": a.quick, "runs": runs, "table": table}, a.json)


if __name__ == "__main__":
    main_guard(main)
