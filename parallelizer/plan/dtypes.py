"""Facts about torch dtypes that every layer reads, total over ``torch``'s dtypes (issue 23,
part 4: a table keyed by a few dtypes raised ``KeyError: torch.complex64`` on a rotary
table).

Autograd tracks exactly the floating-point and complex dtypes (``isDifferentiableType`` in
torch/csrc/autograd/function.h; ``requires_grad_`` refuses every other dtype), so a value
carries gradient only if its dtype is one of them: complex activations (a rotary embedding
applied with ``view_as_complex``) carry it as well as real ones.
"""
from __future__ import annotations

import torch


def differentiable(dtype: torch.dtype) -> bool:
    """Whether autograd can track a tensor of ``dtype`` (floating point or complex)."""
    return dtype.is_floating_point or dtype.is_complex


def all_dtypes() -> list:
    """Every dtype ``torch`` defines (``torch.float32`` ... ``torch.qint8``, ``torch.uint3``),
    once each, sorted by name: what the dtype tables must answer for."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted(found, key=str)
