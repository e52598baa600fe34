"""The redistributions of a settled tp propagation, as plan data (TPDecision.redistributions)
with report.md's lines: each names the op and source line that needed it and the bytes it
moves per rank per step (analysis/sharding/redistribute.py decides them)."""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..analysis.graph_facts import source_line
from ..analysis.sharding.placements import CopiedHeads, LaidOut
from ..plan.decisions import Redistribution
from ..plan.layouts import segments

_RING = {"all_gather": 1.0, "scatter": 1.0, "scatter_copies": 1.0, "scatter_pieces": 1.0,
         "all_reduce": 2.0}


def redistributions(graph: fx.Graph, prop, tp: int) -> list:
    """Redistribution per (producer, placement read) of ``prop.applied`` and per reduce of
    ``prop.applied_reduces``, in graph order of the producers."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    readers: dict = {}
    for consumer, edges in prop.applied.items():
        for producer, want in edges.items():
            readers.setdefault((producer, want), []).append(consumer)
    out = []
    for (producer, want), names in readers.items():
        names = tuple(sorted(names, key=order.__getitem__))
        gather = not hasattr(want, "dim")
        dim = prop.placements[producer].dim if gather else want.dim
        runs = _runs(by_name[producer], want, prop.layouts, tp)
        kind = "all_gather" if gather else "scatter_copies" if isinstance(
            want, CopiedHeads) else "scatter_pieces" if runs else "scatter"
        inner = int(prop.strided.get(producer, 0)) if gather else 0
        out.append(Redistribution(kind, producer, names, dim=dim, inner=inner,
                                  bytes=_bytes(by_name[producer], kind, tp, dim, runs),
                                  why=_why(by_name[names[0]]), runs=runs))
    for name, op in prop.applied_reduces.items():
        node = by_name[name]
        out.append(Redistribution("all_reduce", name, tuple(u.name for u in node.users),
                                  reduce_op=op, bytes=_bytes(node, "all_reduce", tp),
                                  why=_why(node)))
    return sorted(out, key=lambda r: (order[r.producer], r.kind))


def _runs(node: fx.Node, want, layouts: dict, tp: int) -> tuple:
    """Per tp rank, the (full_offset, length) ranges of ``node``'s dim ``want.dim`` that a
    :class:`LaidOut` cut keeps, in the order of the rank's piece; () for every other want,
    and for a linear laid out as the even split (a plain scatter)."""
    layout = layouts.get(want.key) if isinstance(want, LaidOut) else None
    if layout is None:
        return ()
    n = int(node.meta["val"].shape[want.dim])
    return tuple(tuple((s.full_offset, s.length) for s in sorted(
        segments(n, layout, tp, r), key=lambda s: s.piece_offset)) for r in range(tp))


def report_lines(redistributions: list) -> list:
    """One report.md line per redistribution."""
    lines = []
    for r in redistributions:
        what = {"all_gather": f"all-gather (Shard({r.dim}) -> Replicate)",
                "scatter": f"each rank's block (Replicate -> Shard({r.dim}); backward all-gathers "
                           f"the gradient)",
                "scatter_copies": f"each rank's copy of the kv head its query heads read "
                                  f"(Replicate -> copied heads along dim {r.dim}; backward "
                                  f"all-gathers the gradient and sums each head's copies)",
                "scatter_pieces": f"each rank's piece under its linear's layout (Replicate -> "
                                  f"Shard({r.dim}), rank 0's (offset, length) ranges "
                                  f"{list(r.runs[0]) if r.runs else []}; "
                                  f"backward all-gathers the gradient)",
                "all_reduce": f"all-reduce ({r.reduce_op}) of a Partial output"}[r.kind]
        lines.append(f"redistribution: {what} of {r.producer} -> {', '.join(r.readers)} "
                     f"(no sharded rule takes it as it is: {r.why}); "
                     + (f"{r.bytes} bytes per rank per step" if r.bytes else
                        "bytes per step not known at compile time (a data-dependent size)"))
    return lines


def all_reduce_bytes(node: fx.Node, tp: int) -> int:
    """Bytes one rank sends per step to all-reduce ``node``'s value over tp (a ring)."""
    return _bytes(node, "all_reduce", tp)


def example_sizes(node: fx.Node):
    """The sizes of ``node``'s tensor value on the example batch (a symbolic size by its
    hint), or None: no tensor, or a data-dependent size (an MoE layer's tokens)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    sizes = [s.node.hint if isinstance(s, torch.SymInt) else s for s in v.shape]
    return None if any(s is None for s in sizes) else [int(s) for s in sizes]


def _bytes(node: fx.Node, kind: str, tp: int, dim=None, runs=()) -> int:
    """Bytes one rank sends per step for ``node``'s value (the example's shapes), as the
    runtime's operator (runtime/tp.py) moves it. Ring collectives: a rank sends ``tp - 1``
    times the piece each rank contributes. The all-gather (forward) and the scatter's
    backward all-gather contribute a 1/tp block of the whole value; the all-reduce sends
    twice that. ``scatter_copies`` (``n`` entries along ``dim`` copied to tp / n ranks each)
    all-gathers in backward the gradient of each rank's copy, one entry: 1/n of the value,
    not 1/tp; ``scatter_pieces`` the rank's piece, its ``runs`` long along ``dim``."""
    sizes = example_sizes(node)
    if sizes is None:
        return 0
    numel = math.prod(sizes)
    piece = numel / tp
    if kind == "scatter_copies":
        piece = numel / sizes[dim]
    elif kind == "scatter_pieces":
        piece = numel / sizes[dim] * sum(n for _at, n in runs[0])
    return int(_RING[kind] * (tp - 1) * piece * node.meta["val"].element_size())


def _why(node: fx.Node) -> str:
    where = source_line(node)
    return f"{node.target} ({node.name}){f' at {where}' if where else ''}"
