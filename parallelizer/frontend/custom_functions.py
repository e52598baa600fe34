"""A model's own ``torch.autograd.Function``s, which non-strict torch.export inlines.

torch.export(strict=False) traces an autograd.Function's ``forward`` into the graph and
drops its ``backward``: the captured graph differentiates the forward instead. Where the
custom backward is that derivative (BLOOM's GeLUFunction) the program is right; where it is
not (YOSO's YosoCumulation: an approximate gradient of its ``acos`` kernel; a straight-through
estimator) every emitted program, at any layout, would train another model. Capture records
the Functions applied (:func:`recorded`) and, when there are any, compares the captured
graph's gradients with the model's on the example batch (:func:`check_backward`); a
difference is refused naming the Function and the model line that applies it.
"""
from __future__ import annotations

import contextlib
import functools
import os
import traceback

import torch
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError
from .source_lines import shown_path

_FUNCTION = torch.autograd.function.Function


@contextlib.contextmanager
def recorded():
    """Within: each ``apply`` of an autograd.Function defined outside torch is recorded as
    (class name, ``file:line`` of its caller) in the yielded list. So is each call of the
    ``forward`` of such a Function defined before: a library that binds ``apply`` when it is
    imported (mambapy's ``pscan = PScan.apply``) calls the unpatched ``apply``, which was not
    recorded, and its Function went unchecked."""
    seen: list = []
    original = _FUNCTION.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):
            seen.append((cls.__qualname__, _caller()))
        return original.__func__(cls, *args, **kwargs)

    forwards = {cls: cls.__dict__["forward"] for cls in _subclasses(_FUNCTION)
                if not (cls.__module__ or "").startswith("torch.")
                and isinstance(cls.__dict__.get("forward"), staticmethod)}
    _FUNCTION.apply = classmethod(apply)
    for cls, forward in forwards.items():
        cls.forward = staticmethod(_recording(forward.__func__, cls.__qualname__, seen))
    try:
        yield seen
    finally:
        _FUNCTION.apply = original
        for cls, forward in forwards.items():
            cls.forward = forward


def _subclasses(cls) -> set:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def _recording(forward, name: str, seen: list):
    @functools.wraps(forward)
    def recorded_forward(*args, **kwargs):
        seen.append((name, _caller()))
        return forward(*args, **kwargs)
    return recorded_forward


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
            return f"{shown_path(frame.filename)}:{frame.lineno}"
    return "an unknown line"


def check_backward(model: torch.nn.Module, gm: torch.fx.GraphModule, args, kwargs,
                   applied: list, model_file, rtol: float = 1e-3) -> None:
    """Compare the gradients of ``gm`` (flat inputs, flat outputs) with ``model``'s on the
    example batch, both seeded alike (dropout draws the same masks), for a seeded random
    cotangent of every floating-point output. Nothing to compare on the meta device.

    Raises:
        CaptureError: a parameter's gradient differs by more than ``rtol`` of its magnitude,
            or the model has one and the graph none (a forward under ``torch.no_grad``):
            names the Functions applied and where.
    """
    params = dict(model.named_parameters())
    if not applied or any(p.is_meta for p in params.values()):
        return
    state = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    want = _grads(lambda: tree_flatten(model(*args, **kwargs))[0], params.values(), params)
    model.load_state_dict(state)
    flat = [*args, *kwargs.values()]
    mine = dict(gm.named_parameters())
    # {} when no output has a gradient path: every parameter's gradient is None
    got = _grads(lambda: list(gm(*flat)), mine.values(), mine) or dict.fromkeys(mine)
    model.load_state_dict(state)
    for name, w in want.items():
        if w is None or name not in got or not w.abs().max() > 0:
            continue
        g = got[name]
        if g is None:  # no gradient path in the graph: a forward run under torch.no_grad
            detail = (f"the model's gradient of {name} (max {w.abs().max().item():.3g}) has "
                      f"no path in the captured graph: its forward runs under torch.no_grad "
                      f"or detaches, as a reversible residual's does, and only its backward "
                      f"makes the gradient")
        elif (g - w).abs().max() > rtol * max(w.abs().max().item(), 1e-6):
            detail = f"the gradient of {name} differs"
        else:
            continue
        where = ", ".join(dict.fromkeys(f"{cls} at {line}" for cls, line in applied))
        raise CaptureError(
            f"{model_file}: the model applies a torch.autograd.Function ({where}) whose "
            f"backward is not the derivative of its forward ({detail}); torch.export keeps "
            f"the forward only, so the program would train with another gradient. Fix: "
            f"write the Function's gradient as plain tensor operations (a straight-through "
            f"estimator as x + (f(x) - x).detach()), or configure the model not to use it")


def _grads(run, tensors, named) -> dict:
    for p in tensors:
        p.grad = None
    torch.manual_seed(0)
    outs = [o for o in run() if isinstance(o, torch.Tensor) and o.is_floating_point()
            and o.requires_grad]
    if not outs:
        return {}
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in named.items()}
    for p in tensors:
        p.grad = None
    return grads


class _PlainCall:
    """``CheckpointFunction``'s place under :func:`checkpoint_off`: the function, called."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        return function(*args)


def _no_recompute(*args, **kwargs):
    """``_checkpoint_without_reentrant_generator``'s place under :func:`checkpoint_off`: its
    two steps (before the forward, and the end after it) do nothing, so nothing is saved to
    recompute."""
    yield


@contextlib.contextmanager
def checkpoint_off():
    """``torch.utils.checkpoint.checkpoint`` (reentrant or not) as a plain call, for the
    capture and the reference runs of the unmodified model: checkpointing saves memory, not
    values (the program has its own, ``activation_checkpointing``). Captured, the reentrant
    form is an autograd.Function whose forward runs under no_grad: the graph lost the
    block's gradients. In a reference run its recompute runs outside
    ``runtime.rng.EagerDropoutOff`` and ``RandomStandIns`` (the autograd engine does not see
    those modes): a checkpointed block's dropout was active in the recompute only (torch's
    CheckpointError, "different metadata") and a drop path drew real masks there (wrong
    reference gradients)."""
    import torch.utils.checkpoint as cp
    saved = cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator
    cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator = _PlainCall, _no_recompute
    try:
        yield
    finally:
        cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator = saved
