"""A planned layout as a spec that compiles, and its exact memory (compiled on the meta
device) beside the analytical estimate."""
from __future__ import annotations

from pathlib import Path

import torch

from ..compiler import compile_module
from ..frontend.model_file import load_model
from ..frontend.spec import Spec
from .memory import estimate_program

def layout_spec(spec, lay, cluster) -> dict:
    """The spec (a dict) that compiles ``lay``: ``spec``'s other keys unchanged."""
    out = spec.to_dict()
    out["mesh"] = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate,
                   "ep": lay.ep}
    out["pipeline"] = {**out["pipeline"], "microbatches": lay.microbatches if lay.pp > 1 else 1,
                       "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                       "split_points": None, "layers_per_stage": None}
    out["zero_stage"] = lay.zero_stage
    out["activation_checkpointing"] = {**out["activation_checkpointing"],
                                       "mode": "full" if lay.recompute else "none"}
    if lay.zero_stage >= 2:
        out["mixed_precision"] = {"param_dtype": cluster.dtype, "reduce_dtype": None}
    else:
        out["mixed_precision"] = {"param_dtype": "fp32", "reduce_dtype": None}
        out["fsdp"] = {"prefetch": {"forward": None, "backward": None}, "offload": False}
    Spec.model_validate(out)  # what we write must load unchanged
    return out


def exact_memory(model_path, spec, pred, cluster, seq) -> dict:
    """Compile ``pred``'s layout on the meta device and take the exact per-rank estimate
    (``advisor.memory.estimate_program``) for a batch of dp x M x b sequences of ``seq``."""

    lay = pred.candidate
    chosen = Spec.model_validate(layout_spec(spec, lay, cluster))
    loaded = load_model(model_path, on_meta=True)
    n = lay.dp * lay.micro_batch * (lay.microbatches if lay.pp > 1 else 1)
    ex = loaded.batch
    shape = lambda t: [n, seq] + list(t.shape[2:]) if t.dim() >= 2 else [n]
    batch = ({k: torch.zeros(shape(v), dtype=v.dtype) for k, v in ex.items()}
             if isinstance(ex, dict) else tuple(torch.zeros(shape(v), dtype=v.dtype) for v in ex))
    program = compile_module(loaded.model, batch, chosen, loaded.loss_fn, model_file=Path(model_path),
                             reference=False)
    ranks = estimate_program(program.plan, program.sources, batch, loaded.loss_fn,
                             chosen.optimizer.name)
    exact = max(r.total for r in ranks)
    return {"exact_gb": exact / 1e9, "analytic_gb": pred.memory_bytes / 1e9,
            "ratio": exact / pred.memory_bytes}
