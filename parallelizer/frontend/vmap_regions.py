"""``torch.vmap`` in forward, as torch.export's pre-dispatch graph writes it: a level entered
(``_vmap_increment_nesting``), inputs given a batch dim at it (``_add_batch_dim``), the
function's ops on per-sample shapes, outputs taken off it (``_remove_batch_dim``), the
level left (``_vmap_decrement_nesting``). Entering and leaving read nothing back, so the
nodes doing it have no users; every reader of the graph must still keep them in place."""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._functorch import predispatch

ENTER, LEAVE = predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting
ADD, REMOVE = predispatch._add_batch_dim, predispatch._remove_batch_dim
VMAP_LEVELS = frozenset({ENTER, LEAVE})


def vmapped(graph: fx.Graph) -> dict:
    """Node -> the ``ENTER`` node of the outermost level it runs inside, for every node
    between a level's entry and its exit (both excluded)."""
    out, open_ = {}, []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is LEAVE:
            if open_:
                open_.pop()
            continue
        if open_:
            out[n] = open_[0]
        if n.op == "call_function" and n.target is ENTER:
            open_.append(n)
    return out


@contextlib.contextmanager
def levels_restored():
    """Leave the vmap levels a failing run of a graph entered: an exception between a level's
    entry and its exit skips the exit, and every later eager run (the model's reference
    step) ran inside that level, whose random ops then failed, "vmap: called random
    operation while in randomness error mode", an error blamed on the model (zoo 25 F3)."""
    depth = _depth()
    try:
        yield
    finally:
        while _depth() > depth:
            torch._C._functorch._vmap_decrement_nesting()


def _depth() -> int:
    level = torch._C._functorch.maybe_current_level()
    return 0 if level is None else level
