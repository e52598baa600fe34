"""Small helpers shared by the benchmark scripts: medians, the table, the JSON file, the
machine description, and the subprocesses (compile with the real CLI, launch with torchrun)."""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BENCH_MODEL = REPO / "benchmarks" / "models" / "llama_bench.py"
BENCH_SPEC = REPO / "benchmarks" / "models" / "spec.yaml"
# One intra-op thread per process: ranks outnumber the cores here, and oversubscription
# makes gloo runs several times slower and far noisier.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class BenchmarkError(RuntimeError):
    """A benchmark could not run (a failed subprocess, no GPU for --device cuda)."""


def median(xs) -> float:
    return float(statistics.median(xs))


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0]}


def check_device(device: str, world: int) -> None:
    """Refuse ``--device cuda`` without enough GPUs, before anything starts.

    Raises:
        BenchmarkError: names what is missing and the fix (``--device cpu``).
    """
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise BenchmarkError(f"--device cuda needs a CUDA GPU, but torch.cuda.is_available() is "
                             f"False here (torch {torch.__version__}); run with --device cpu "
                             f"(gloo) or on a machine with a GPU")
    if torch.cuda.device_count() < world:
        raise BenchmarkError(f"--device cuda runs one rank per GPU (NCCL): this needs {world} "
                             f"GPUs, {torch.cuda.device_count()} are visible; run with --device cpu")


def fmt(x, digits=3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    """A Markdown table (printed and returned, so README rows can be pasted as they are)."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, data: dict, path: Path | None = None) -> Path:
    """``benchmarks/results/NAME.json`` (or ``path``), written atomically."""
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "machine": machine(), **data}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(data, f, indent=2)
    os.replace(f.name, path)
    print(f"wrote {path}", flush=True)
    return path


def run(cmd: list[str], env: dict | None = None, timeout: float = 600, what: str = "") -> str:
    """Run ``cmd``; its stdout, or BenchmarkError with the tail of its output."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=REPO, timeout=timeout)
    if p.returncode != 0:
        raise BenchmarkError(f"{what or cmd[2]} failed (exit {p.returncode}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p.stdout


def compile_program(out: Path, overrides: list[str], model: Path = BENCH_MODEL, spec: Path = BENCH_SPEC,
                    env: dict | None = None) -> Path:
    """``parallelize MODEL SPEC -o OUT OVERRIDES`` with the real CLI (weights included)."""
    run([sys.executable, "-m", "parallelizer", str(model), str(spec), "-o", str(out), *overrides],
        env=env, what="parallelize")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, module: str, args: list[str], env: dict | None = None, timeout: float = 600) -> str:
    """``torchrun --nproc-per-node NPROC -m MODULE ARGS`` on a fresh port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    return run(cmd, env=env, timeout=timeout, what=f"torchrun {module}")


def bench_env(quick: bool) -> dict:
    return {**ENV, "PZ_BENCH_SIZE": "quick" if quick else "full"}


def run_worker(program: Path, nproc: int, args: list[str], env: dict | None = None,
               module: str = "benchmarks._worker") -> dict:
    """``module`` (default benchmarks._worker) under torchrun on ``program``; rank 0's result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        torchrun(nproc, module, ["--program", str(program), "--result", str(result), *args],
                 env=env)
        return json.loads(result.read_text())


def mesh_overrides(tp: int = 1, dp: int = 1, pp: int = 1) -> list[str]:
    """The mesh; at pp = 1 also ``pipeline.microbatches=1``: the spec's microbatches would
    split (accumulate) the step there, which the native baseline at pp = 1 does not."""
    return [f"mesh.tp={tp}", f"mesh.dp={dp}", f"mesh.pp={pp}"] + (
        ["pipeline.microbatches=1"] if pp == 1 else [])


def base_parser(description: str, json_name: str):
    import argparse
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (the smoke test)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"where to write the figures (default benchmarks/results/{json_name}.json)")
    return p


def main_guard(fn) -> None:
    """Run ``fn()``; a BenchmarkError prints one clear line and exits 2."""
    try:
        fn()
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
