"""The layout planner's predicted step time against the emitted program's measured one, on
this machine (same run, ratios only).

1. Calibrate: ``torchrun --nproc-per-node 4 -m parallelizer calibrate`` on a cluster file
   describing this machine as one node of 4 ranks (``parallelize calibrate``, quick).
2. For each layout of ``LAYOUTS`` (tp / pp / dp, ZeRO stage, microbatches, activation
   checkpointing, interleaving; world 4): compile ``examples/llama`` with the real CLI and
   predict its step with ``parallelize plan``'s model (``advisor.step_time.predict`` on the
   captured workload and the calibrated cluster).
3. Measure every program with ``torchrun --nproc-per-node 4 OUT/run.py --train`` as a user
   runs it: the time between consecutive ``step N loss`` lines rank 0 prints (each step ends
   with the loss's all-reduce, so every rank is done), the first ``--warmup`` steps dropped.
   The layouts run in ``--rounds`` interleaved rounds (the order reversed every other round),
   so that load from elsewhere falls on all of them alike; a layout's figure is the median
   of all its steps, its spread the interquartile range.
4. Print predicted vs measured per layout, the ratio, and Kendall's τ between the two
   orders; the 1-minute load average is recorded at every launch.

    python -m benchmarks.planner_vs_measured [--quick] [--rounds 2] [--steps 8] [--json PATH]
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import ENV, REPO, base_parser, free_port, main_guard, print_table, run, write_json

MODEL = REPO / "examples" / "llama" / "model.py"
SPEC = REPO / "examples" / "llama" / "spec.yaml"
BATCH = 8  # examples/llama's batches(): 8 sequences of 16 tokens
# name -> (tp, pp, dp, zero stage, microbatches, virtual stages, checkpointing)
LAYOUTS = {
    "tp4": (4, 1, 1, 0, 1, 1, False),
    "tp2-dp2 ddp": (2, 1, 2, 0, 1, 1, False),
    "tp2-dp2 zero3": (2, 1, 2, 3, 1, 1, False),
    "tp2-dp2 ddp ac": (2, 1, 2, 0, 1, 1, True),
    "tp2-pp2 m4": (2, 2, 1, 0, 4, 1, False),
    "pp2-dp2 m4": (1, 2, 2, 0, 4, 1, False),
    "pp2-dp2 m4 v2": (1, 2, 2, 0, 4, 2, False),
    "pp4 m4": (1, 4, 1, 0, 4, 1, False),
    "pp4 m8": (1, 4, 1, 0, 8, 1, False),
    "dp4 ddp": (1, 1, 4, 0, 1, 1, False),
    "dp4 zero1": (1, 1, 4, 1, 1, 1, False),
    "dp4 zero3": (1, 1, 4, 3, 1, 1, False),
}
QUICK = ("tp2-dp2 ddp", "pp2-dp2 m4")
CLUSTER = """# this machine as one node of 4 ranks (processes); `parallelize calibrate` measures the rest
nodes: 1
gpus_per_node: 4
gpu: {name: cpu, memory_gb: 4, memory_bandwidth_gb_s: 10, tflops: {bf16: 0.05, fp16: 0.05, fp32: 0.1}}
dtype: fp32
"""
_STEP = re.compile(r"^step (\d+) loss ")


def overrides(layout: tuple) -> list[str]:
    tp, pp, dp, z, m, v, ac = layout
    out = [f"mesh.tp={tp}", f"mesh.pp={pp}", f"mesh.dp={dp}", f"zero_stage={z}",
           f"pipeline.microbatches={m}", f"pipeline.virtual_stages={v}",
           f"pipeline.schedule={'interleaved_1f1b' if v > 1 else '1f1b'}",
           f"activation_checkpointing.mode={'full' if ac else 'none'}"]
    return out


def candidate(layout: tuple):
    from parallelizer.advisor.step_time import Candidate
    tp, pp, dp, z, m, v, ac = layout
    return Candidate(tp, pp, dp, BATCH // (dp * m), m, z, v, ac)


def calibrate(folder: Path, mode: str) -> Path:
    path = folder / "this-machine.yaml"
    path.write_text(CLUSTER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "parallelizer", "calibrate",
           "--cluster", str(path), "--mode", mode]
    print(run(cmd, what="parallelize calibrate").strip().splitlines()[-1], flush=True)
    return path


def step_times(out: Path, steps: int, warmup: int) -> tuple[list[float], float]:
    """Seconds between consecutive ``step N loss`` lines of ``run.py --train``, and the
    1-minute load average at the start."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(out / "run.py"), "--train",
           "--steps", str(steps + warmup + 1), "--device", "cpu"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         cwd=REPO, bufsize=1)
    stamps = []
    for line in p.stdout:
        if _STEP.match(line):
            stamps.append(time.perf_counter())
    err = p.stderr.read()
    if p.wait() != 0:
        raise RuntimeError(f"run.py --train of {out} failed (exit {p.returncode}):\n{err[-3000:]}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return gaps[warmup:], load


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-b of the two orders (``scipy.stats.kendalltau``)."""
    from scipy.stats import kendalltau
    return float(kendalltau(xs, ys).statistic)


def predict_all(cluster_path: Path, names: list[str]) -> dict:
    from parallelizer.advisor.capture import capture_workload
    from parallelizer.advisor.cluster import load_cluster
    from parallelizer.advisor.step_time import predict
    cluster = load_cluster(cluster_path)
    w = capture_workload(MODEL, None)
    out = {}
    for name in names:
        p = predict(w, cluster, candidate(LAYOUTS[name]), global_batch=BATCH)
        out[name] = {"step_s": p.step_s, "terms_s": p.terms}
    return out


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "planner_vs_measured")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8; quick 6)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None)
    a = p.parse_args()
    names = a.layouts or (list(QUICK) if a.quick else list(LAYOUTS))
    rounds, steps = a.rounds or (1 if a.quick else 2), a.steps or (6 if a.quick else 8)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        load0 = os.getloadavg()[0]
        cluster_path = calibrate(tmp, "test" if a.quick else "quick")
        outs = {}
        for name in names:
            outs[name] = tmp / re.sub(r"\W+", "-", name)
            run([sys.executable, "-m", "parallelizer", str(MODEL), str(SPEC), "-o", str(outs[name]),
                 *overrides(LAYOUTS[name])], what=f"parallelize ({name})")
        predicted = predict_all(cluster_path, names)
        measured: dict = {n: [] for n in names}
        loads: dict = {n: [] for n in names}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                gaps, load = step_times(outs[name], steps, a.warmup)
                measured[name] += gaps
                loads[name].append(load)
                print(f"round {r + 1} {name}: median {statistics.median(gaps) * 1e3:.1f} ms "
                      f"(load {load:.1f})", flush=True)
        calibration = cluster_path.read_text()
    report(names, predicted, measured, loads, load0, calibration, a)


def report(names, predicted, measured, loads, load0, calibration, a) -> None:
    rows, pred, meas = [], [], []
    for n in names:
        m = statistics.median(measured[n])
        q = statistics.quantiles(measured[n], n=4) if len(measured[n]) > 1 else [m, m, m]
        ps = predicted[n]["step_s"]
        pred.append(ps)
        meas.append(m)
        rows.append([n, f"{ps * 1e3:.1f}", f"{m * 1e3:.1f}", f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}",
                     f"{ps / m:.2f}", f"{ps / m - 1:+.0%}", "yes" if abs(ps / m - 1) <= 0.2 else "NO",
                     f"{statistics.mean(loads[n]):.1f}"])
    tau = kendall_tau(pred, meas)
    within = sum(abs(p / m - 1) <= 0.2 for p, m in zip(pred, meas))
    table = print_table(f"planner vs measured: examples/llama, world 4, gloo/CPU{', quick' if a.quick else ''}",
                        ["layout", "predicted ms", "measured ms (median)", "measured IQR ms",
                         "pred/meas", "error", "within 20 %", "load avg"], rows)
    print(f"\nKendall tau (predicted vs measured order): {tau:.2f} (target >= 0.7); within +-20 %: "
          f"{within}/{len(names)}; 1-min load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end", flush=True)
    write_json("planner_vs_measured", {"quick": a.quick, "layouts": names, "predicted": predicted,
                                       "measured_s": measured, "load_avg": loads, "kendall_tau": tau,
                                       "within_20": within, "table": table,
                                       "calibration": calibration}, a.json)


if __name__ == "__main__":
    main_guard(main)
