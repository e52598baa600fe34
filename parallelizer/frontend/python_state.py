"""Python numbers a model's forward changes on every call (a step counter on a module).

Capture runs ``forward`` once and records the ops it ran; a Python number the forward reads
is a constant of that one call. A block counting its calls (``self.calls += 1``) to warm up
its residual (``min(1.0, (self.calls + 1) / 4)``) was captured with the first call's 0.25,
and every training step after the first then computed another function than the model
(zoo 20 Z3: ``--verify``, one step, PASSed). Caches that change once (a rotary table's
length grown to the example's) are left alone: only a number that changes again on a second
call with the same inputs, and changes the output, is refused.
"""
from __future__ import annotations


import torch
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError
from . import python_rng
from .module_state import buffer_values_kept, state_kept
from .source_lines import in_torch, shown_path

_NUMBERS = (bool, int, float)


def numbers(model: torch.nn.Module) -> dict:
    """``(module fqn, attribute) -> value`` of every Python number held by a submodule
    (``training`` aside: the compiler sets it)."""
    return {(fqn, k): v for fqn, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, _NUMBERS) and k != "training"}


def refuse_per_call_numbers(model: torch.nn.Module, args, kwargs, model_file) -> None:
    """Raise CaptureError when ``model``'s forward changes a Python number of a submodule on
    every call (two eager calls on the example batch, the same random draws, buffers put back
    between them) and the output with it; on the meta device, where no output can be
    compared, when it changes at all on every call. The model is left as it was.

    Raises:
        CaptureError: names the attribute, its values over two calls, the line that sets it
            and the fix.
    """
    with state_kept(model), torch.random.fork_rng(devices=[]), torch.no_grad(), \
            python_rng.kept():
        before = numbers(model)
        first = _call(model, args, kwargs)
        once = numbers(model)
        if first is None or once == before:
            return
        second = _call(model, args, kwargs)
        twice = numbers(model)
    moving = sorted(k for k, v in once.items() if twice.get(k, v) != v)
    on_meta = any(t.is_meta for t in first)
    if not moving or second is None or not on_meta and _same(first, second):
        return
    names = [f"{f}.{n}" if f else n for f, n in moving]
    name, kind = moving[0][1], type(once[moving[0]]).__name__
    line = _line_setting(model, args, kwargs, moving[0])
    effect = ("; the compile cannot tell whether the output depends on it (no weights: compile "
              "with them to check)" if on_meta else ", and the model's output changes with it")
    raise CaptureError(
        f"the model from {model_file} changes {names[0]} (a Python {kind}) "
        f"on every call of forward ({before[moving[0]]} -> {once[moving[0]]} -> "
        f"{twice[moving[0]]}{f', at {line}' if line else ''}){effect}. Capture runs forward "
        f"once, so the program would keep that call's value ({before[moving[0]]}) in every "
        f"step while the model's moves on.\nFix: hold it in a tensor buffer that forward "
        f"updates in place (self.register_buffer('{name}', torch.zeros(())); "
        f"self.{name}.add_(1)) and compute with tensor ops on it (.clamp, torch.where), which "
        f"the program runs every step as the model does; or pass it to forward as an input."
        + (f" Also changing on every call: {', '.join(names[1:])}." if len(names) > 1 else ""))


def _call(model, args, kwargs):
    """The output tensors of one seeded call, buffers put back after it; None when the
    model fails eagerly (the capture reports that itself)."""
    torch.manual_seed(0)
    try:
        with buffer_values_kept(model):
            out = model(*args, **kwargs)
    except Exception:  # noqa: BLE001  (not this check's to report)
        return None
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _line_setting(model, args, kwargs, key) -> str | None:
    """``FILE:LINE`` of the model's line after which the attribute ``key`` changed, in one
    more call (the model put back as it was)."""
    fqn, name = key
    module = model.get_submodule(fqn)
    found, last = [], [None]

    def trace(frame, event, arg):
        if not found and getattr(module, name, None) != start:
            found.append(last[0])
        if event == "line" and not in_torch(frame.f_code.co_filename):  # not Module.__setattr__
            last[0] = f"{shown_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        return trace

    start = getattr(module, name)
    with python_rng.kept():
        python_rng.traced_call(model, args, kwargs, trace)
    return found[0] if found else None
