"""Dtype fixes the emitted program calls under mixed precision."""
from __future__ import annotations

from typing import Optional

import torch


def in_stats_dtype(t: Optional[torch.Tensor], stats: torch.Tensor) -> Optional[torch.Tensor]:
    """A batch norm's weight or bias ``t`` in the dtype of its running statistics ``stats``.

    FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` casts the parameters it gathers, never
    the buffers, so a BatchNorm met bf16 weights beside fp32 running statistics, which
    ``aten.batch_norm`` refuses ("expected scalar type BFloat16 but found Float"); with fp32
    weights and statistics it takes the bf16 input, as under autocast. Differentiable; the
    identity when the dtypes agree (every fp32 run)."""
    return t if t is None or t.dtype == stats.dtype else t.to(stats.dtype)


def in_range_of(t: torch.Tensor, value: float) -> float:
    """``value`` clamped to the range of ``t``'s dtype: a fill value a model computed as
    ``torch.finfo(scores.dtype).min`` while captured in fp32 (-3.4e38, the Hugging Face mask
    idiom) is that dtype's own minimum when ``t`` is bf16 or fp16 under
    ``mixed_precision.param_dtype``, as the model under autocast computes it; fp16 refused
    the fp32 value ("value cannot be converted to type c10::Half without overflow", zoo 25
    F7). The value itself for fp32 and for every value the dtype holds."""
    if not t.is_floating_point():
        return value
    info = torch.finfo(t.dtype)
    return min(max(value, info.min), info.max)
