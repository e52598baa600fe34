"""Training metrics of ``run.py --train --log-every N`` (rank 0 prints and writes them).

Every N optimizer steps one row: the step, its loss (the global mean over the step's
batches), the global gradient norm before clipping (runtime/clip.py), the learning rate the
step used, tokens/s over the N steps (every rank's tokens: global batch x sequence x
grad_accum per step), MFU and the peak memory over all ranks. The same rows go to
``LOG_DIR/metrics.jsonl`` (appended, so a resumed run continues the file), to TensorBoard
event files in LOG_DIR when the ``tensorboard`` package is installed (extra
``parallelizer[metrics]``), and at the end to ``LOG_DIR/loss.png`` (matplotlib): the loss of
every step logged in the file, and the evaluation loss.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, appendix B) = the model's FLOPs per
token x tokens/s / (peak FLOP/s per device x world size). The model's FLOPs are the plan's
(``plan.structure``: forward + backward of every unit at the compile's example batch, from
the captured graph; recomputation under activation checkpointing not counted), divided by
the example's tokens. The peak is ``--peak-tflops`` when given, else the device's from
:data:`CUDA_PEAKS` (dense, by compute dtype), else, on CPU, a measured fp32 matmul rate of
this rank; the first row says which.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# dense peak FLOP/s by device name fragment and compute dtype (vendor data sheets; fp32 is
# the TF32 tensor-core rate torch uses for matmuls with allow_tf32, not enabled by default:
# the plain fp32 rate is given instead)
CUDA_PEAKS = {"H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
              "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
              "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
              "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
              "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}}


def plan_flops_per_token(plan, example_tokens: int | None) -> float | None:
    """Forward + backward FLOPs per token of the whole model (module docstring), or None
    when the plan records no costs or the example's token count is unknown."""
    s = plan.structure or {}
    if not example_tokens or "block_costs" not in s:
        return None
    return (s["pre_cost"] + sum(s["block_costs"]) + s["post_cost"]) / example_tokens


def device_peak(device: torch.device, dtype: str, given_tflops: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one device, how it was found)."""
    if given_tflops:
        return given_tflops * 1e12, f"--peak-tflops {given_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in CUDA_PEAKS.items():
            if key in name:
                return peaks[dtype], f"{name} {dtype} dense data-sheet peak"
    return _measured_matmul(device), (f"measured {dtype if device.type == 'cuda' else 'fp32'} "
                                      f"1024^3 matmul on {device.type}, {torch.get_num_threads()} thread(s)")


def _measured_matmul(device: torch.device, n: int = 1024, reps: int = 3) -> float:
    a = torch.randn(n, n, device=device, generator=None)
    best = math.inf
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        (a @ a).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def peak_memory(device: torch.device) -> int:
    """This process's peak bytes: CUDA max_memory_allocated, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class Metrics:
    """Collects a row every ``every`` steps (:meth:`step`); rank 0 prints and writes it."""

    def __init__(self, ctx, every: int, log_dir: Path | None, flops_per_token: float | None,
                 peak: tuple[float, str], world: int):
        self.ctx, self.every, self.world = ctx, every, world
        self.flops_per_token, (self.peak, self.peak_source) = flops_per_token, peak
        self.log_dir = Path(log_dir) if log_dir else None
        self.tokens, self.t0, self.first = 0, time.perf_counter(), True
        self.writer = None
        if self.log_dir and ctx.rank == 0:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = _tensorboard(self.log_dir)

    def restart_clock(self) -> None:
        self.tokens, self.t0 = 0, time.perf_counter()

    def step(self, step: int, loss: float, grad_norm, lr: float, tokens: int) -> None:
        """After optimizer step ``step`` (1-based) of ``tokens`` tokens (all ranks').
        Collective every ``every`` steps (the peak memory is a max over ranks)."""
        self.tokens += tokens
        if step % self.every:
            return
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        elapsed = time.perf_counter() - self.t0
        mem = torch.tensor([float(peak_memory(self.ctx.device))], device=self.ctx.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tps = self.tokens / elapsed if elapsed > 0 else float("nan")
        mfu = (self.flops_per_token * tps / (self.peak * self.world)
               if self.flops_per_token and self.peak else None)
        row = {"step": step, "loss": loss, "grad_norm": None if grad_norm is None else float(grad_norm),
               "lr": lr, "tokens": tokens, "tokens_per_s": tps, "mfu": mfu,
               "peak_memory_bytes": int(mem.item())}
        self.emit(row)
        self.restart_clock()

    def emit(self, row: dict) -> None:
        if self.ctx.rank != 0:
            return
        if self.first:
            self.first = False
            print(f"metrics: mfu against a peak of {self.peak / 1e12:.4g} TFLOP/s per device "
                  f"({self.peak_source}) x {self.world} devices; model "
                  f"{(self.flops_per_token or 0) / 1e6:.4g} MFLOP per token (plan costs, "
                  f"forward + backward)", flush=True)
        sys.stdout.write(format_row(row) + "\n")
        sys.stdout.flush()
        if self.log_dir:
            with open(self.log_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.ctx.rank != 0 or not self.log_dir:
            return
        if self.writer is not None:
            self.writer.close()
        path = plot_losses(self.log_dir / "metrics.jsonl", self.log_dir / "loss.png")
        if path:
            print(f"metrics: {self.log_dir / 'metrics.jsonl'}, loss curve {path}", flush=True)


def format_row(row: dict) -> str:
    """One log line: ``log step 10 | loss 4.123456 | grad_norm ... | eval_loss ... | ppl ...``."""
    parts = [f"log step {row['step']}"]
    for key, fmt in (("loss", "{:.6f}"), ("grad_norm", "{:.8f}"), ("lr", "{:.4e}"),
                     ("tokens_per_s", "{:.4g}"), ("mfu", "{:.3%}"), ("eval_loss", "{:.6f}"),
                     ("perplexity", "{:.4f}")):
        if row.get(key) is not None:
            parts.append(f"{key.replace('_per_s', '/s')} {fmt.format(row[key])}")
    if row.get("peak_memory_bytes") is not None:
        parts.append(f"peak_mem {row['peak_memory_bytes'] / 2 ** 20:.1f} MiB")
    return " | ".join(parts)


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a step logged twice (a resumed run) keeps its last row."""
    train, evals = {}, {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        (evals if "eval_loss" in row else train)[row["step"]] = row
    return [train[k] for k in sorted(train)] + [evals[k] for k in sorted(evals)]


def plot_losses(jsonl: Path, png: Path) -> Path | None:
    """loss.png from ``jsonl`` (None when matplotlib is missing or there is nothing)."""
    if not jsonl.is_file():
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_rows(jsonl)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _tensorboard(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("metrics: TensorBoard events not written: the tensorboard package is not "
              "installed (pip install 'parallelizer[metrics]')", flush=True)
        return None
    return SummaryWriter(str(log_dir))
