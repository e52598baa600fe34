"""``run.py --train --profile``: what this rank actually holds, as one ``MEMORY {json}`` line.

Bytes are counted from the local tensors after the last training step (gradients and
optimizer state still allocated): FSDP2 parameters and gradients are DTensors, counted by
their local shard (``to_local()``); ``ZeroRedundancyOptimizer`` counts the state of its
local partition only (``.optim.state``). A tensor (or tied alias) is counted once. The peak
is ``torch.cuda.max_memory_allocated`` on CUDA and the process's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``, which includes the Python interpreter and torch
itself) on CPU. ``parallelize estimate`` predicts the first three figures.
"""
from __future__ import annotations

import json
import resource
import sys

import torch

from .setup import RankContext


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    unique = {id(t): t for t in tensors}  # the originals, kept alive, so ids are not reused
    return sum(_local(t).numel() * _local(t).element_size() for t in unique.values())


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list:
    """Every tensor of the optimizer state this rank holds (its partition under ZeRO-1)."""
    local = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
    return [v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure(stage: torch.nn.Module, opt: torch.optim.Optimizer, ctx: RankContext) -> dict:
    """Bytes this rank holds: parameters, gradients, optimizer state, buffers, and the peak.

    Returns:
        ``{"rank", "pp", "dp", "tp", "parameters", "gradients", "optimizer", "buffers",
        "peak", "peak_kind"}``, sizes in bytes.
    """
    params = list(stage.parameters())
    if ctx.device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(ctx.device), "cuda_max_memory_allocated"
    else:
        # ru_maxrss is in KiB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "process_peak_rss"
    return {"rank": ctx.rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank, "tp": ctx.tp_rank,
            "parameters": _nbytes(params),
            "gradients": _nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": _nbytes(optimizer_state_tensors(opt)),
            "buffers": _nbytes(stage.buffers()),
            "peak": int(peak), "peak_kind": kind}


def print_memory(stage: torch.nn.Module, opt: torch.optim.Optimizer, ctx: RankContext) -> None:
    """Print ``MEMORY {json}`` (one line, this rank) in one write: ranks share stdout, and
    ``print`` writes the text and the newline separately, so two ranks' lines could merge."""
    sys.stdout.write("MEMORY " + json.dumps(measure(stage, opt, ctx), sort_keys=True) + "\n")
    sys.stdout.flush()


def _proc_kib(field: str) -> int:
    import re
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def start_save_measure(ctx: RankContext) -> int:
    """Before a save: reset the peak counter (Linux ``/proc/self/clear_refs`` 5 resets VmHWM;
    CUDA: ``reset_peak_memory_stats``) and return the bytes held now (VmRSS; CUDA allocated)."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
        return torch.cuda.memory_allocated(ctx.device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_kib("VmRSS") * 1024


def print_save_memory(ctx: RankContext, before: int, written: int, largest: int) -> None:
    """``SAVE_MEMORY {json}``: this rank's peak during a save above what it held before
    (``rise``), beside the bytes it wrote (its own shards) and the largest tensor's bytes."""
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
    else:
        peak = _proc_kib("VmHWM") * 1024
    line = {"rank": ctx.rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank, "tp": ctx.tp_rank,
            "before": before, "peak": peak, "rise": max(0, peak - before),
            "own_shards": written, "largest_tensor": largest}
    sys.stdout.write("SAVE_MEMORY " + json.dumps(line, sort_keys=True) + "\n")
    sys.stdout.flush()
