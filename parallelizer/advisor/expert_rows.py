"""Rows per expert for the estimate's forward when the model counts them at run time.

Per-module experts (a loop over an ``nn.ModuleList``, each expert taking its rows by
``torch.where`` or a boolean mask; passes/stack_experts.py) give FakeTensors of unbacked
sizes: one symbol per expert, whose value is the routing's. ``parallelize estimate`` assumes balanced routing, as
it does for the all-to-all buffers (runtime/expert_parallel.py ``BalancedShapes``): each of
a layer's E experts gets ``1/E`` of the (token, choice) pairs its mask is taken over, i.e.
``mask.numel() / E`` rows (the mask of ``selected_experts == i`` is (tokens, top_k)).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime import grouped_mm  # noqa: F401  (registers parallelizer::row_offsets)


class BalancedExpertRows(TorchDispatchMode):
    """Records the mask size behind each ``nonzero``'s (or ``x[mask]``'s) row symbol and, at the
    ``parallelizer::row_offsets`` of a stacked layer, sets each of its E experts' row count
    to that size over E; :meth:`value` makes a size an int with them (0 for a symbol no
    stacked layer counted)."""

    def __init__(self):
        super().__init__()
        self.mask_numel: dict = {}
        self.values: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        mask = _mask(func, args)
        if mask is not None and isinstance(out.shape[0], torch.SymInt):
            self.mask_numel[out.shape[0].node.expr] = int(mask.numel())
        elif func is torch.ops.parallelizer.row_offsets.default:
            for rows in args[0]:
                n = rows.shape[0]
                if isinstance(n, torch.SymInt) and n.node.expr in self.mask_numel:
                    self.values[n.node.expr] = self.mask_numel[n.node.expr] // len(args[0])
        return out

    def value(self, size) -> int:
        """``size`` (an int, SymInt or SymFloat) with every row symbol at its balanced value."""
        if not isinstance(size, (torch.SymInt, torch.SymFloat)):
            return int(size)
        expr = size.node.expr
        return int(expr.xreplace({s: self.values.get(s, 0) for s in expr.free_symbols}))


def _mask(func, args):
    """The routing mask whose true entries an op's rows count: ``nonzero``'s input, or the
    boolean index of ``x[mask]`` (a bool index reaches the fake kernel as ``aten.index``,
    which counts its rows without a ``nonzero`` this mode would see)."""
    if func is torch.ops.aten.nonzero.default:
        return args[0]
    if func is torch.ops.aten.index.Tensor:
        return next((i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool), None)
    return None
