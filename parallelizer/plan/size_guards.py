"""torch.export's guards on the inputs' sizes (``ep._guards_code``: ``L['idx'].size()[1] !=
64``) evaluated at sizes other than the example's. The compiler classifies each guard with it
(``frontend/guards.py``) and keeps in the plan the ones a run can meet (``size_guards``);
``run.py`` evaluates those at the batch and sequence length it is asked for, before any
forward (``runtime/data_source.py``).
"""
from __future__ import annotations

import math

import torch


class _Sizes:
    def __init__(self, shape):
        self.shape = shape

    def size(self):
        return self.shape


class _Inputs(dict):
    """``L[...]`` of a guard: any key chain ends at the input its last key names."""

    def __missing__(self, key):
        return self


def holds(text, shapes: dict):
    """The guard ``text`` (or its compiled code) with each input's shape from ``shapes``
    (``{input name: shape}``): True, False, or None when it cannot be evaluated (a name it
    reads is not in ``shapes``)."""
    inputs = _Inputs({n: _Sizes(list(shape)) for n, shape in shapes.items()})
    try:
        return bool(eval(text, {"L": inputs, "math": math, "torch": torch}))  # noqa: S307
    except Exception:
        return None


def resized(shapes: dict, size: int, new: int, extra=()) -> dict:
    """``shapes`` with dim 0 or 1 of every input that is ``size`` set to ``new``: the batch,
    or the sequence every input shares (Flux's per-position ids ``(S, 3)`` beside
    ``(B, S, D)``), resized together; and each ``(input, dim)`` of ``extra`` of that size
    (:func:`sequence_dims`: a (B, S, S) mask's dim 2)."""
    extra = {tuple(e) for e in extra}
    return {n: [new if s == size and (k < 2 or (n, k) in extra) else s
                for k, s in enumerate(shape)] for n, shape in shapes.items()}


def sequence_dims(shapes: dict) -> tuple:
    """``(input name, dim)`` of each dim past 1 that is the symbol of some input's dim 1 in
    the captured graph (``shapes``: ``{name: symbolic shape}``): an explicit (B, S, S) mask's
    dim 2 is the sequence length, and a run resizes it with dim 1."""
    lengths = {str(s[1]) for s in shapes.values() if len(s) > 1 and not str(s[1]).isdigit()}
    return tuple((n, k) for n, s in shapes.items() for k in range(2, len(s))
                 if str(s[k]) in lengths)


def first_broken(guards, dim: int, value: int, extra=()):
    """The first of ``guards`` (plan ``size_guards`` entries ``(input name, dim, example size,
    guard, shapes, excluded)``) on ``dim`` that ``value`` breaks, else None. ``extra``:
    ``plan.sequence_dims``."""
    for guard in guards:
        _, d, size, text, shapes, _ = guard
        if d == dim and value != size and holds(
                text, resized(shapes, size, value, extra if d == 1 else ())) is False:
            return guard
    return None


def spans_text(spans) -> str:
    """``((64, 64), (65, 128))`` as ``"64, 65..128"``."""
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
