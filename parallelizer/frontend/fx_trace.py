"""``torch.fx.symbolic_trace`` as a capture route, refused wherever the trace runs something
it does not record. symbolic_trace runs the model's Python once on Proxies; anything that is
not an op on a Proxy happens at trace time and is gone from the graph:

- a random draw that reads no traced value (``torch.rand([])``): its value would be a
  constant of every step (LayerDrop's skip decided forever);
- a read of a real tensor's value (``if self.initted:``, ``int(buffer)``, ``.item()``): the
  branch the model's state took at compile would be the program's for ever, with no
  warning (routing-transformer's lazily initialised k-means, zoo 16 Z9). torch.export
  reads buffers as inputs and refuses such a branch, or decides it openly under
  ``capture.data_dependent_branches: as_example``;
- a change of grad mode (``torch.no_grad()``): the region's ops are recorded, the mode is
  not, and the program's gradient would flow where the model's does not (the same model:
  the centroids written under no_grad carried a gradient into the block before).

Any of these fails the route, and capture goes on to the next one (:mod:`.capture`).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that turn a tensor's value into a Python value
_VALUE_READS = frozenset({torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                          torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.tolist})


class UnrecordedByTrace(RuntimeError):
    """symbolic_trace ran something the graph does not record (module docstring)."""


def symbolic_trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace(model)`` that records everything it runs.

    Raises:
        UnrecordedByTrace: the trace drew random numbers, read a real tensor's value or
            changed the grad mode (module docstring).
    """
    state = torch.random.get_rng_state()
    with _Unrecorded():
        traced = torch.fx.symbolic_trace(model)
    if not torch.equal(state, torch.random.get_rng_state()):
        torch.random.set_rng_state(state)
        raise UnrecordedByTrace("symbolic_trace drew random numbers at trace time")
    return traced


class _Unrecorded(TorchFunctionMode):
    """Stops the trace at a value read of a real tensor or a grad-mode change."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor):
            raise UnrecordedByTrace(f"symbolic_trace read a tensor's value ({func.__name__})")
        if func is torch._C._set_grad_enabled and bool(args[0]) != torch.is_grad_enabled():
            raise UnrecordedByTrace("symbolic_trace ran a region under another grad mode")
        return func(*args, **kwargs)
