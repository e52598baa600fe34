"""The conditions on the inputs' sizes under which the captured graph computes what the
model computes. torch.export keeps the batch and sequence dims symbolic, but model code
that turns an expression of them into a Python number (a router's capacity
``int(1.25 * tokens / experts)``, ``math.floor(seq / 2)``) is traced with the example's
value, and export records the condition as a guard (``ep._guards_code``: ``math.trunc(
0.5*torch.sym_float(L['x'].size()[1])) == 8``), checked by the exported module's
``_guards_fn``, which the flat program drops. The guards are kept here and evaluated for
other sizes: a dim whose doubling breaks one is fixed at the example's size, as a size the
graph holds as a number is (``analysis/outputs.py``): the compile says so and ``run.py``
refuses another; a batch whose share per microbatch and dp rank breaks one refuses that
layout. A guard that only relates dims (``32*s1*s0 == 160*s0``: s1 == 5) or bounds one (a
position table's length) fixes no other.
"""
from __future__ import annotations

import math
import re

import torch

_SIZE = re.compile(r"L((?:\['[^']+'\])+)\.size\(\)\[(\d+)\]")
_KEY = re.compile(r"\['([^']+)'\]")
SHAPE_GUARDS = "shape_guards"  # gm.meta key
FIXED_BY = "fixed_by"  # gm.meta key: why capture held the sequence (or batch) static


def record_shape_guards(gm: torch.fx.GraphModule, ep, names, values) -> None:
    """Store in ``gm.meta`` ``ep``'s guards on the inputs' dims 0 and 1 with the example's
    sizes of every input (``names`` and their ``values``, flat, in placeholder order)."""
    sizes = {n: tuple(int(s) for s in v.shape) for n, v in zip(names, values)
             if isinstance(v, torch.Tensor)}
    texts = [t for t in getattr(ep, "_guards_code", None) or ()
             if any(d < 2 and name in sizes for name, d in _reads(t))]
    gm.meta[SHAPE_GUARDS] = (tuple(texts), sizes)


def pinned(gm: torch.fx.GraphModule, symbolic) -> list[tuple[str, str, int, int]]:
    """``(guard, input name, dim, example size)`` for each dim 0 or 1 of ``symbolic`` (the
    ``(input, dim)`` the graph holds as symbols; one it holds as a number is fixed anyway)
    that a guard holds at the example's size only: doubling it, with dims 0 and 1 of every
    input of that size (the batch, the sequence the inputs share, Flux's per-position ids
    ``(S, 3)`` beside ``(B, S, D)``), breaks the guard."""
    texts, sizes = gm.meta.get(SHAPE_GUARDS, ((), {}))
    out = []
    for text in texts:
        for name, d in dict.fromkeys(_reads(text)):
            if (name, d) not in symbolic or name not in sizes:
                continue
            size = sizes[name][d]
            together = {(n, k): 2 for n, shape in sizes.items() for k in (0, 1)
                        if len(shape) > k and shape[k] == size}
            if _holds(text, sizes, together) is not True:
                out.append((text, name, d, size))
    return out


def batch_breaks(gm: torch.fx.GraphModule, chunks: int):
    """The first guard that the batch cut into ``chunks`` (dp x microbatches) breaks:
    ``(guard, input name, example batch, least, fixed)``, ``least`` the fewest samples per
    chunk from which the guard holds for every share up to the whole batch (2 for a guard
    that only excludes one sample, ``B != 1``: torch's 0/1 specialisation around a
    ``chunk``), ``fixed`` when only the example batch holds it (not twice as many either:
    WavLM's ``B != 1`` at an example batch of 2 is a least of 2, not a fixed batch); or
    None."""
    texts, sizes = gm.meta.get(SHAPE_GUARDS, ((), {}))
    for text in texts:
        batched = [name for name, d in _reads(text) if d == 0 and name in sizes]
        if batched and _holds(text, sizes, {(n, 0): 1 / chunks for n in sizes}) is not True:
            batch = sizes[batched[0]][0]
            least = batch
            while least > 1 and _holds(text, sizes, {(n, 0): (least - 1) / batch
                                                     for n in sizes}) is True:
                least -= 1
            # held by twice the example too: a least, not the one size it runs
            fixed = least == batch and _holds(text, sizes, {(n, 0): 2 for n in sizes}) is not True
            return text, batched[0], batch, least, fixed
    return None


def _reads(text: str) -> list[tuple[str, int]]:
    """``(input name, dim)`` of each size the guard reads: the last key of ``L[...]``."""
    return [(_KEY.findall(keys)[-1], int(d)) for keys, d in _SIZE.findall(text)]


class _Sizes:
    def __init__(self, shape):
        self.shape = shape

    def size(self):
        return self.shape


class _Inputs(dict):
    """``L[...]`` of a guard: any key chain ends at the input its last key names."""

    def __missing__(self, key):
        return self


def _holds(text: str, sizes: dict, scale: dict):
    """The guard ``text`` with each ``(input, dim)`` of ``scale`` multiplied by its factor
    (rounded down, at least 1): True, False, or None when it cannot be evaluated."""
    inputs = _Inputs({n: _Sizes([max(1, int(s * scale.get((n, d), 1)))
                                 for d, s in enumerate(shape)]) for n, shape in sizes.items()})
    try:
        return bool(eval(text, {"L": inputs, "math": math, "torch": torch}))  # noqa: S307
    except Exception:
        return None
