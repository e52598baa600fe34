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
