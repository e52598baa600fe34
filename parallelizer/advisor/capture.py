"""The advisor's view of a model file: its per-unit FLOPs and parameters as a
:class:`~parallelizer.advisor.workload.Workload`, captured once on the meta device."""
from __future__ import annotations

from pathlib import Path

import torch

from ..compiler import analyse, measure
from ..frontend.model_file import load_model
from ..passes.manager import PassManager
from .workload import Workload

_WORKLOADS: dict = {}


def capture_workload(model_path: Path, seq: int | None):
    """:func:`_capture_workload`, once per (file, modification time, seq) in a process."""
    path = Path(model_path).resolve()
    key = (path, path.stat().st_mtime_ns, seq)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = _capture_workload(path, seq)
    return _WORKLOADS[key]


def _capture_workload(model_path: Path, seq: int | None):
    """Capture ``model_path`` on the meta device at 2 x ``seq`` tokens (default the
    example's; 2 rather than 1 so that export keeps the batch dim dynamic) with the
    compiler's front end (:func:`parallelizer.compiler.analyse` and ``measure``: the same
    capture, attention rewrite and costs), and turn its per-unit costs, halved to one
    sequence, into a Workload."""
    loaded = load_model(model_path, on_meta=True)
    model = loaded.model
    batch = _meta_batch(loaded.batch, seq)
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    seq = first.shape[1]
    passes = PassManager()
    costs = measure(analyse(model, batch, Path(model_path), passes), passes).costs
    seen, params, tied = set(), [], 0.0
    for i, u in enumerate(costs.units):
        new = [f for f in u.params if f not in seen]
        if i == len(costs.units) - 1:
            tied = sum(costs.param_bytes[f] for f in u.params if f in seen) / 4
        seen.update(new)
        params.append(sum(costs.param_bytes[f] for f in new) / 4)   # fp32 model: 4 bytes each
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or max(1, int(costs.cut_bytes[1] // (2 * seq * 4)))
    heads = getattr(cfg, "num_attention_heads", None) or max(1, hidden // 64)
    vocab = getattr(cfg, "vocab_size", 0) or 0
    return Workload(f"{Path(model_path).parent.name}/{Path(model_path).name}", seq, hidden, heads, vocab,
                    tuple(u.fwd_flops / 2 for u in costs.units),
                    tuple(u.bwd_flops / 2 for u in costs.units), tuple(params), tied,
                    ends_tp_sharded=False, flash=True)


def _meta_batch(batch, seq):

    def one(t):
        shape = [2] + list(t.shape[1:])
        if seq and t.dim() >= 2:
            shape[1] = seq
        return torch.zeros(shape, dtype=t.dtype, device="meta")
    return {k: one(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(one(v) for v in batch)
