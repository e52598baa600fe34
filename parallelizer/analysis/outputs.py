"""The model's flat outputs under microbatches: which carry the batch dim, which are losses.

torch.distributed.pipelining merges each output of the last stage over microbatches by
``output_merge_spec`` (``microbatch.merge_chunks``): concatenated along dim 0 by default,
or reduced by a ``_CustomReducer``. A 0-dim floating-point output (Hugging Face
``outputs.loss`` when forward gets ``labels=``, an MoE auxiliary loss) is the model's own
mean over the samples it saw, so the program reduces it as the mean over microbatches,
the same mean ``scale_grads=True`` takes of the gradients; any other output must have the
batch dim first.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import PlanError


def _flat_outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.output_node()
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in out.args[0]]
    return vals


def scalar_outputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Indices of the 0-dim floating-point flat outputs (losses, averaged over microbatches
    and data-parallel ranks)."""
    return tuple(i for i, v in enumerate(_flat_outputs(gm))
                 if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point())


def check_outputs_have_batch_dim(gm: fx.GraphModule, input_names) -> None:
    """Under pp > 1 every output but a 0-dim floating-point one (a loss) is concatenated over
    microbatches along dim 0, which fails on a run for an output without the batch dim.

    Raises:
        PlanError: names the output, its shape and the fix.
    """
    first = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == input_names[0])
    batch = first.meta["val"].shape[0]
    scalars = set(scalar_outputs(gm))
    for i, val in enumerate(_flat_outputs(gm)):
        if i in scalars or not isinstance(val, torch.Tensor):
            continue
        if val.dim() == 0 or str(val.shape[0]) != str(batch):
            shape = "()" if val.dim() == 0 else str(list(val.shape))
            raise PlanError(
                f"output {i} of the model has shape {shape} ({val.dtype}), without the batch dim "
                f"of the inputs first; under mesh.pp > 1 each output is concatenated over "
                f"microbatches along dim 0 (a 0-dim floating-point output, a loss, is averaged "
                f"instead), so return per-sample values and reduce them in loss_fn, or use "
                f"mesh.pp=1")
