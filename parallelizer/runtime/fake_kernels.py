"""Dispatch modes for the compile's fake forwards (emit/rank_check.py, advisor/activations.py).

A model compiled without weights is captured on the meta device, where its code may take the
branch written for a device other than the CPU; the fake forwards then follow CPU kernels,
which refuse some of those ops. Each mode here runs such an op as the CPU branch would, with
the same output shape and dtype.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class IntegerHistcOnFloat(TorchDispatchMode):
    """``aten.histc`` of an integer tensor, run on its float copy and cast back (same (bins,)
    shape): transformers' MoE counts rows per expert with ``histc`` of the integer ids off
    the CPU and of their float copy on it; CPU kernels refuse integer ``histc``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)
