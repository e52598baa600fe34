"""The conditions on the inputs' sizes under which the captured graph computes what the
model computes. torch.export keeps the batch and sequence dims symbolic, but model code
that turns an expression of them into a Python number (a router's capacity
``int(1.25 * tokens / experts)``, ``math.floor(seq / 2)``) is traced with the example's
value, and export records the condition as a guard (``ep._guards_code``: ``math.trunc(
0.5*torch.sym_float(L['x'].size()[1])) == 8``), checked by the exported module's
``_guards_fn``, which the flat program drops. The guards are kept here and evaluated for
other sizes: a dim that one holds near the example's size only (not at twice or three times
it) is fixed at the example's size, as a size the graph holds as a number is
(``analysis/outputs.py``): the compile says so and ``run.py`` refuses another; a batch whose
share per microbatch and dp rank breaks one refuses that layout. A guard that only relates
dims (``32*s1*s0 == 160*s0``: s1 == 5), bounds one (a position table's length) or excludes
some sizes (``T != 64``) fixes none: the plan keeps it, and ``run.py`` refuses a size that
breaks it.
"""
from __future__ import annotations

import re

import torch

from ..plan.size_guards import holds, resized, sequence_dims

_SIZE = re.compile(r"L((?:\['[^']+'\])+)\.size\(\)\[(\d+)\]")
_KEY = re.compile(r"\['([^']+)'\]")
SHAPE_GUARDS = "shape_guards"  # gm.meta key
FIXED_BY = "fixed_by"  # gm.meta key: why capture held the sequence (or batch) static


def record_shape_guards(gm: torch.fx.GraphModule, ep, names, values) -> None:
    """Store in ``gm.meta`` ``ep``'s guards on the inputs' dims 0 and 1 with the example's
    sizes of every input (``names`` and their ``values``, flat, in placeholder order) and
    the other dims that are a sequence length (``plan/size_guards.sequence_dims``)."""
    sizes = {n: tuple(int(s) for s in v.shape) for n, v in zip(names, values)
             if isinstance(v, torch.Tensor)}
    texts = [t for t in getattr(ep, "_guards_code", None) or ()
             if any(d < 2 and name in sizes for name, d in _reads(t))]
    symbolic = {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
                if n.op == "placeholder" and n.name in sizes
                and isinstance(n.meta.get("val"), torch.Tensor)}
    gm.meta[SHAPE_GUARDS] = (tuple(texts), sizes, sequence_dims(symbolic))


def pinned(gm: torch.fx.GraphModule, symbolic) -> list[tuple[str, str, int, int]]:
    """``(guard, input name, dim, example size)`` for each dim 0 or 1 of ``symbolic`` (the
    ``(input, dim)`` the graph holds as symbols; one it holds as a number is fixed anyway)
    that a guard holds near the example's size only: twice and three times it, with dims 0
    and 1 of every input of that size (the batch, the sequence the inputs share), both
    break the guard (``math.trunc(0.125*T) == 2``). A guard that one of them keeps
    (nanoGPT's ``T != 64`` from a mask buffer of 64 sliced by the length, at an example of
    32) excludes sizes, not fixes one: :func:`kept`."""
    extra = gm.meta.get(SHAPE_GUARDS, ((), {}, ()))[2]
    return [(text, name, d, size) for text, name, d, size, sizes in _guarded(gm, symbolic)
            if _pins(text, sizes, size, extra if d == 1 else ())]


def kept(gm: torch.fx.GraphModule, symbolic) -> list[tuple]:
    """``(input name, dim, example size, guard, shapes, excluded)`` for each guard on a dim
    of ``symbolic`` that does not pin it (:func:`pinned`) but breaks at some size from 2 to
    four times the example's (at least 256): the plan keeps it and run.py evaluates it at
    the size a run asks for (``plan/size_guards.py``). ``shapes``: the example shapes of the
    inputs it reads; ``excluded``: the sizes that break it, as ``(first, last)`` spans. A
    guard that only relates sizes (``L['mask'].size()[2] == L['ids'].size()[1]``) holds at
    every size and is left out."""
    out = []
    every = gm.meta.get(SHAPE_GUARDS, ((), {}, ()))[2]
    for text, name, d, size, sizes in _guarded(gm, symbolic):
        extra = every if d == 1 else ()
        if _pins(text, sizes, size, extra):
            continue
        shapes = {n: list(sizes[n]) for n, _ in _reads(text) if n in sizes}
        code = compile(text, "<guard>", "eval")
        broken = [v for v in range(2, max(4 * size, 256) + 1)
                  if holds(code, resized(shapes, size, v, extra)) is False]
        if broken:  # a guard that only relates sizes holds at every one
            out.append((name, d, size, text, shapes, _spans(broken)))
    return out


def _guarded(gm: torch.fx.GraphModule, symbolic):
    """``(guard, input name, dim, example size, example sizes)`` per guard and symbolic dim
    0 or 1 it reads (each once per guard)."""
    texts, sizes, _ = gm.meta.get(SHAPE_GUARDS, ((), {}, ()))
    for text in texts:
        for name, d in dict.fromkeys(_reads(text)):
            if (name, d) in symbolic and name in sizes:
                yield text, name, d, sizes[name][d], sizes


def _pins(text: str, sizes: dict, size: int, extra) -> bool:
    return all(holds(text, resized(sizes, size, k * size, extra)) is not True for k in (2, 3))


def _spans(values: list[int]) -> tuple:
    """Consecutive runs of sorted ``values`` as ``(first, last)`` pairs."""
    out: list = []
    for v in values:
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return tuple(tuple(p) for p in out)


def batch_breaks(gm: torch.fx.GraphModule, chunks: int):
    """The first guard that the batch cut into ``chunks`` (dp x microbatches) breaks:
    ``(guard, input name, example batch, least, fixed, most)``, ``least`` the fewest samples per
    chunk from which the guard holds for every share up to the whole batch (2 for a guard
    that only excludes one sample, ``B != 1``: torch's 0/1 specialisation around a
    ``chunk``), ``fixed`` when only the example batch holds it (not twice as many either:
    WavLM's ``B != 1`` at an example batch of 2 is a least of 2, not a fixed batch),
    ``most`` the most samples that hold it where twice the batch does not, else None
    (TabNet's ``ceil(B / 8) == 2`` at 16: 9..16, a range a larger example batch moves); or
    None."""
    texts, sizes, _ = gm.meta.get(SHAPE_GUARDS, ((), {}, ()))
    for text in texts:
        batched = [name for name, d in _reads(text) if d == 0 and name in sizes]
        if batched and _holds(text, sizes, {(n, 0): 1 / chunks for n in sizes}) is not True:
            batch = sizes[batched[0]][0]
            least = batch
            while least > 1 and _holds(text, sizes, {(n, 0): (least - 1) / batch
                                                     for n in sizes}) is True:
                least -= 1
            # held by twice the example too: a least, not the one size it runs
            most = None  # held by twice the example too: no bound above
            if _holds(text, sizes, {(n, 0): 2 for n in sizes}) is not True:
                most = batch
                while _holds(text, sizes, {(n, 0): (most + 1) / batch for n in sizes}) is True:
                    most += 1
            return text, batched[0], batch, least, least == batch and most is not None, most
    return None


def _reads(text: str) -> list[tuple[str, int]]:
    """``(input name, dim)`` of each size the guard reads: the last key of ``L[...]``."""
    return [(_KEY.findall(keys)[-1], int(d)) for keys, d in _SIZE.findall(text)]


def _holds(text: str, sizes: dict, scale: dict):
    """The guard ``text`` with each ``(input, dim)`` of ``scale`` multiplied by its factor
    (rounded down, at least 1): True, False, or None when it cannot be evaluated."""
    return holds(text, {n: [max(1, int(s * scale.get((n, d), 1))) for d, s in enumerate(shape)]
                        for n, shape in sizes.items()})
