"""vmap_levels pass: each ``torch.vmap`` level spans only the ops of its function.

torch.export's pre-dispatch graph writes a ``torch.vmap`` in forward as a level entered
(``_vmap_increment_nesting``), inputs given a batch dim at it (``_add_batch_dim``), the
function's ops, outputs taken off it (``_remove_batch_dim``) and the level left. The passes
insert their operators (a sequence-parallel gather, a tp region's f or g) before the op
that needs them: before an ``_add_batch_dim``, that is inside the level, where a
``torch.autograd.Function`` refuses to run ("it must override the setup_context
staticmethod": s5-pytorch's S5Block at tp 2, zoo 25 F3). Entering a level later, just
before its first batch dim is added, and leaving it right after its last is removed,
changes nothing the function computes and puts those operators outside it.
"""
from __future__ import annotations

import torch.fx as fx

from ..frontend.vmap_regions import ADD as _ADD, ENTER as _ENTER, LEAVE as _LEAVE, \
    REMOVE as _REMOVE


def apply_vmap_levels(gm: fx.GraphModule) -> bool:
    """Move each level's entry down to its first ``_add_batch_dim`` and its exit up to its
    last ``_remove_batch_dim`` (``args[2]`` / ``args[1]``: the level, its nesting depth).
    True if any node moved."""
    nodes, depth, opened, moved = list(gm.graph.nodes), 0, {}, False
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        if n.target is _ENTER:
            depth += 1
            opened[depth] = n
        elif n.target is _LEAVE:
            last = _last_removal(nodes[:i], depth)
            if last is not None and last.next is not n:
                last.append(n)
                moved = True
            depth -= 1
        elif n.target is _ADD and opened.get(n.args[2]) is not None:
            enter = opened.pop(n.args[2])
            if enter.next is not n and not _reads_between(enter, n):
                n.prepend(enter)
                moved = True
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _last_removal(before: list, level: int):
    """The last ``_remove_batch_dim`` at ``level`` in ``before``, until its level's entry."""
    for n in reversed(before):
        if n.op == "call_function" and n.target is _ENTER:
            return None
        if n.op == "call_function" and n.target is _REMOVE and n.args[1] == level:
            return n
    return None


def _reads_between(enter: fx.Node, add: fx.Node) -> bool:
    """Whether a node between ``enter`` and ``add`` reads ``enter`` (then it stays)."""
    n = enter.next
    while n is not add:
        if enter in n.all_input_nodes:
            return True
        n = n.next
    return False
