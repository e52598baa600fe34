"""Gradient hooks, refused at capture: torch.export keeps none.

A hook that changes a gradient (``a.register_hook(lambda g: g * 0.5)`` in forward, GLM-130B's
shrink of the embedding gradient; ``module.register_full_backward_hook(...)``) is no op of the
captured graph, so the program's gradients were not the model's: an "internal error" where
the self-check ran, no word where it did not (a model over its limits), and ``--verify``
FAILed (zoo 18 Z11). Forward hooks and pre-hooks run during capture and are in the graph.
"""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import torch
from torch.nn.modules import module as nn_module

from ..errors import CaptureError
from .source_lines import in_torch, shown_path

_FIX = ("torch.export keeps no gradient hooks, so the program's gradients would not be the "
        "model's. Write the change into forward instead: a gradient scaled by s is "
        "x * s + x.detach() * (1 - s) (the same value, s times the gradient); or leave the "
        "hook out of the model you compile")


def check_module_hooks(model: torch.nn.Module, model_file: Path) -> None:
    """Refuse backward hooks on the model's modules or registered globally.

    Raises:
        CaptureError: names the module FQN (or "every module") and the fix.
    """
    hooked = [name or "<the model>" for name, m in model.named_modules()
              if getattr(m, "_backward_hooks", None) or getattr(m, "_backward_pre_hooks", None)]
    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        hooked.insert(0, "every module (a global backward hook)")
    if hooked:
        more = f" and {len(hooked) - 1} more" if len(hooked) > 1 else ""
        raise CaptureError(f"the model from {model_file} has a backward hook on "
                           f"{hooked[0]}{more} (register_full_backward_hook, "
                           f"register_backward_hook or a pre-hook); {_FIX}")


@contextlib.contextmanager
def tensor_hooks_refused(model_file: Path):
    """Around a capture: a ``Tensor.register_hook`` call made by the model's code (not
    torch's) is recorded, and refused after it.

    Raises:
        CaptureError: names the model's line that registered the hook and the fix.
    """
    sites: list = []
    original = torch.Tensor.register_hook

    def recording(self, hook):
        caller = traceback.extract_stack(limit=2)[0]  # torch's own calls (its overrides) pass
        if not in_torch(caller.filename):
            sites.append(f"{shown_path(caller.filename)}:{caller.lineno}")
        return original(self, hook)

    torch.Tensor.register_hook = recording
    try:
        yield
    finally:
        torch.Tensor.register_hook = original
    if sites:
        raise CaptureError(f"the model from {model_file} registers a gradient hook on a "
                           f"tensor in forward (Tensor.register_hook at {sites[0]}); {_FIX}")
