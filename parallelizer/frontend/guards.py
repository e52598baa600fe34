"""The conditions on the inputs' sizes under which the captured graph computes what the
model computes. torch.export keeps the batch and sequence dims symbolic, but model code
that turns an expression of them into a Python number (a router's capacity
``int(1.25 * tokens / experts)``, ``math.floor(seq / 2)``) is traced with the example's
value, and export records the condition as a guard (``ep._guards_code``: ``math.trunc(
0.5*torch.sym_float(L['x'].size()[1])) == 8``), checked by the exported module's
``_guards_fn``, which the flat program drops. A size a guard reads is therefore fixed at
the example's, as a size the graph holds as a number is (``analysis/outputs.py``): the
compile says so, ``run.py`` refuses another, and a layout that runs fewer samples at a
time (microbatches, dp) is refused when the batch is guarded.
"""
from __future__ import annotations

import re

import torch

_SIZE = re.compile(r"L((?:\['[^']+'\])+)\.size\(\)\[(\d+)\]")
_KEY = re.compile(r"\['([^']+)'\]")
SHAPE_GUARDS = "shape_guards"  # gm.meta key


def record_shape_guards(gm: torch.fx.GraphModule, ep, names, values) -> None:
    """Store in ``gm.meta`` each of ``ep``'s equality guards on dims 0 or 1 of the inputs
    (``names`` and their example ``values``, flat, in placeholder order) as ``(text,
    ((input name, dim, example size), ...))``."""
    sizes = {n: v.shape for n, v in zip(names, values) if isinstance(v, torch.Tensor)}
    found = []
    for text in getattr(ep, "_guards_code", None) or ():
        if " == " not in text:  # a bound (a position table's length) only limits the size
            continue
        dims = []
        for keys, dim in _SIZE.findall(text):
            name, d = _KEY.findall(keys)[-1], int(dim)
            if name in sizes and d < min(2, len(sizes[name])):
                dims.append((name, d, int(sizes[name][d])))
        if dims:
            found.append((text, tuple(dict.fromkeys(dims))))
    gm.meta[SHAPE_GUARDS] = found


def shape_guards(gm: torch.fx.GraphModule) -> list:
    """What :func:`record_shape_guards` stored: ``[(guard text, ((name, dim, size), ...))]``."""
    return list(gm.meta.get(SHAPE_GUARDS, ()))
