"""Compile time and peak memory of ``parallelize --no-weights`` on the Llama-3-70B config
(examples/llama70b, meta device, tp=8, pp=4, dp=2) beside ``torch.export`` alone of the same
model (built on meta, ``export(strict=False)``, batch and sequence dims ``Dim.AUTO``: what
a user who only captures the model runs). Each runs in its own fresh process, so its peak
RSS (``wait4``'s ``ru_maxrss``) is its own; the runs alternate (export, parallelize,
parallelize, export, ...). Times are of the call, after the imports both share (wall and
CPU seconds: CPU time is the figure to trust on a shared machine, it excludes time spent
preempted); the whole process's wall time is reported too. Targets: parallelize <= 1.5x export's time; <= 2 GB peak.

    python -m benchmarks.compile [--quick] [--repeats N]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import (ENV, REPO, BenchmarkError, base_parser, main_guard, median, print_table,
                      write_json)

TIME_TARGET, MEMORY_TARGET_GB = 1.5, 2.0
FULL = dict(model=REPO / "examples" / "llama70b", overrides=["mesh.tp=8", "mesh.pp=4", "mesh.dp=2"])
QUICK = dict(model=REPO / "examples" / "llama", overrides=["mesh.tp=2", "mesh.pp=2", "mesh.dp=2"])


def _child_export(model_dir: Path) -> None:
    import torch
    from torch.export import Dim

    from parallelizer.frontend.model_file import load_model  # imports model.py, nothing else
    loaded = load_model(model_dir / "model.py", on_meta=True)
    model = loaded.model
    batch = {k: v.to("meta") for k, v in loaded.batch.items()}
    dynamic = {k: {0: Dim.AUTO, 1: Dim.AUTO} for k in batch}
    torch.export.export(model, (), kwargs=batch, dynamic_shapes=dynamic, strict=False)


def _child_parallelize(model_dir: Path, overrides: list[str]) -> None:
    from parallelizer.compiler import compile_to_dir
    from parallelizer.frontend.spec import load_spec
    spec = load_spec(model_dir / "spec.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        compile_to_dir(model_dir / "model.py", spec, Path(tmp) / "out", weights=False)


def _timed_child(kind: str, model_dir: Path, overrides: list[str]) -> dict:
    """Imports first (both children share them: torch, transformers), then the timed call."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from parallelizer import compiler  # noqa: F401
    t0, c0 = time.perf_counter(), time.process_time()
    if kind == "export":
        _child_export(model_dir)
    else:
        _child_parallelize(model_dir, overrides)
    return {"call_s": time.perf_counter() - t0, "call_cpu_s": time.process_time() - c0}


def run_child(kind: str, cfg: dict) -> dict:
    """One fresh process; its call time, wall time and peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "benchmarks.compile", "--child", kind, "--model-dir", str(cfg["model"]),
               "--child-result", str(result), *cfg["overrides"]]
        log = Path(tmp) / "stderr.txt"
        with open(log, "w") as err:  # a file, not a pipe: nothing reads while wait4 waits
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise BenchmarkError(f"{kind} child failed (exit {code}):\n{log.read_text()[-4000:]}")
        call = json.loads(result.read_text())
    return {"kind": kind, **call, "process_wall_s": wall, "process_cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gb": usage.ru_maxrss / 2**20}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "compile")
    p.add_argument("--repeats", type=int, default=None, help="runs of each (default 2; quick 1)")
    p.add_argument("--child", choices=("export", "parallelize"), help=argparse_hidden())
    p.add_argument("--model-dir", type=Path, help=argparse_hidden())
    p.add_argument("--child-result", type=Path, help=argparse_hidden())
    a, overrides = p.parse_known_args()
    if a.child:
        a.child_result.write_text(json.dumps(_timed_child(a.child, a.model_dir, overrides)))
        return
    cfg = QUICK if a.quick else FULL
    runs = []
    for i in range(a.repeats or (1 if a.quick else 2)):
        order = ("export", "parallelize") if i % 2 == 0 else ("parallelize", "export")
        runs += [run_child(kind, cfg) for kind in order]
    figures = ("call_s", "call_cpu_s", "process_wall_s", "process_cpu_s", "peak_rss_gb")
    med = {k: {m: median([r[m] for r in runs if r["kind"] == k]) for m in figures} for k in ("export", "parallelize")}
    ratio = med["parallelize"]["call_s"] / med["export"]["call_s"]
    cpu_ratio = med["parallelize"]["call_cpu_s"] / med["export"]["call_cpu_s"]
    wall_ratio = med["parallelize"]["process_wall_s"] / med["export"]["process_wall_s"]
    peak = max(r["peak_rss_gb"] for r in runs if r["kind"] == "parallelize")
    name = f"{cfg['model'].name} {' '.join(cfg['overrides'])} --no-weights"
    rows = [["time of the call (median)", f"{med['parallelize']['call_s']:.1f} s", f"{med['export']['call_s']:.1f} s",
             f"{ratio:.2f}x", f"<= {TIME_TARGET}x", "yes" if ratio <= TIME_TARGET else "NO"],
            ["CPU time of the call (median)", f"{med['parallelize']['call_cpu_s']:.1f} s",
             f"{med['export']['call_cpu_s']:.1f} s", f"{cpu_ratio:.2f}x", f"<= {TIME_TARGET}x",
             "yes" if cpu_ratio <= TIME_TARGET else "NO"],
            ["process wall time (median)", f"{med['parallelize']['process_wall_s']:.1f} s",
             f"{med['export']['process_wall_s']:.1f} s", f"{wall_ratio:.2f}x", "-", "-"],
            ["peak RSS (max)", f"{peak:.2f} GB", f"{max(r['peak_rss_gb'] for r in runs if r['kind'] == 'export'):.2f} GB",
             "-", f"<= {MEMORY_TARGET_GB} GB", "yes" if peak <= MEMORY_TARGET_GB else "NO"]]
    table = print_table(f"compile: {name} ({len(runs) // 2} run(s) each)",
                        ["figure", "parallelize", "torch.export alone", "ratio", "target", "met"], rows)
    write_json("compile", {"quick": a.quick, "config": name, "runs": runs, "median": med, "time_ratio": ratio,
                           "cpu_time_ratio": cpu_ratio, "peak_rss_gb": peak, "targets": {"time_ratio": TIME_TARGET, "peak_gb": MEMORY_TARGET_GB},
                           "met": {"time": ratio <= TIME_TARGET, "cpu_time": cpu_ratio <= TIME_TARGET,
                                   "memory": peak <= MEMORY_TARGET_GB},
                           "table": table}, a.json)


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main_guard(main)
