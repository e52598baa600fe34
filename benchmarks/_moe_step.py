"""``python -m benchmarks.step_time --moe``: the training step of a Mixtral whose experts
dominate it (benchmarks/models/mixtral_bench.py: hidden 256, 8 experts of FFN 512, top-2,
4 layers, batch 8 x 64) at dp2 x ep2 against tp2, both world 2, both emitted by the real CLI.

- ep2 (``mesh.dp=2 mesh.ep=2``): each rank its half of the batch and half of every layer's
  experts, tokens exchanged by all-to-all (docs/expert-parallel.md); the dense rest under
  the spec's ZeRO-3 over dp.
- tp2 (``mesh.tp=2``): attention and the LM head sharded over tp, the stacked expert
  weights replicated (every tp rank runs every expert on the whole batch: tensor
  parallelism inside the experts is not done on main).

Both programs run in the same torchrun job (benchmarks/_moe_worker.py), stepped alternately
on the same global batches with AdamW, barrier-timed, equal losses asserted at every step.
Figure: median step time and median CPU time (rank 0) over ``--steps`` steps after the
warm-up; ratio ep2 / tp2 (below 1: ep2 faster).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ._common import bench_env, compile_program, median, print_table, run_worker, write_json
from ._moe_comm import MODEL, SPEC

MESHES = {"ep2": ["mesh.dp=2", "mesh.ep=2"], "tp2": ["mesh.tp=2"]}


def measure(steps: int, warmup: int, quick: bool) -> dict:
    env = {**bench_env(quick), "PZ_BENCH_ROUTING": "random"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {name: compile_program(Path(tmp) / name, m + ["pipeline.microbatches=1"], model=MODEL,
                                      spec=SPEC, env=env) for name, m in MESHES.items()}
        r = run_worker(outs["ep2"], 2, ["--program", str(outs["tp2"]), "--steps", str(steps),
                                        "--warmup", str(warmup)], env=env, module="benchmarks._moe_worker")
    med = {k: median(v) for k, v in r["times"].items()}
    cpu = {k: median(v) for k, v in r["cpu_times"].items()}
    return {**r, "median_s": med, "median_cpu_s": cpu, "ratio": med["ep2"] / med["tp2"],
            "cpu_ratio_rank0": cpu["ep2"] / cpu["tp2"]}


def main(quick: bool, json_path, steps: int | None = None) -> None:
    steps = steps or (3 if quick else 7)
    r = measure(steps, 1 if quick else 2, quick)
    row = [["ep2 (dp2 x ep2) vs tp2 (experts replicated)", "cpu (gloo)", len(r["times"]["ep2"]),
            r["tokens_per_step"], f"{r['median_s']['ep2']:.3f}", f"{r['median_s']['tp2']:.3f}",
            f"{r['ratio']:.3f}", f"{r['median_cpu_s']['ep2']:.3f}", f"{r['median_cpu_s']['tp2']:.3f}",
            f"{r['cpu_ratio_rank0']:.3f}", f"{r['max_loss_diff']:.1e}"]]
    table = print_table(f"step_time --moe: Mixtral ({'quick' if quick else 'hidden 256, 8 experts x FFN 512, top-2, 4 layers'})"
                        f", world 2",
                        ["config", "device", "steps", "tokens/step", "ep2 s (median)", "tp2 s (median)",
                         "ep2/tp2", "ep2 CPU s (rank 0)", "tp2 CPU s (rank 0)", "ep2/tp2 CPU time",
                         "max loss diff"], row)
    write_json("step_time_moe", {"quick": quick, "run": r, "table": table}, json_path)
