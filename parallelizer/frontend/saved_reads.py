"""Reads of a tensor that is written in place later, copied where they are read.

An autograd.Function's forward runs without autograd recording, so it may write in place
into views of its own tensors after an op has read them (mambapy's ``PScan``: ``Xa[:, :,
1:, 0].add_(Aa[:, :, 1:, 0].mul(Xa[:, :, :-1, 1]))``, a scan over slices of two clones).
torch.export inlines that forward, and the captured graph runs it under autograd: the
``mul`` saves its operands for backward, the later ``add_`` into the same tensor bumps their
version, and the graph's backward fails ("one of the variables needed for gradient
computation has been modified by an inplace operation"), as did every emitted program.

Each such read is of a copy taken where the op reads it (``mul(clone(a), clone(b))``): the
values are those the op read, the copy is what autograd saves and nothing writes it, and the
gradient reaches the written tensor through the clone as through the read.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_rewrite import caller, returns_view, val, view_base, written_inputs

_aten = torch.ops.aten
# their backward reads none of their arguments (or they read no tensor's values at all)
_NOT_SAVED = {_aten.clone.default, _aten.sym_size.int, _aten.sym_stride.int,
              _aten.sym_numel.default, _aten.sym_storage_offset.default,
              _aten.add.Tensor, _aten.add_.Tensor, _aten.sub.Tensor, _aten.sub_.Tensor,
              _aten.neg.default, _aten.copy_.default, _aten._to_copy.default, _aten.to.dtype,
              _aten.topk.default}  # a router's: its backward reads the indices
# nor does theirs with one tensor argument (``q[:, :k] * 0.5``)
_SCALED = {_aten.mul.Tensor, _aten.mul_.Tensor, _aten.div.Tensor, _aten.div_.Tensor}


def copy_reads_before_writes(gm: fx.GraphModule) -> bool:
    """Give each op that reads a tensor the forward made (a ``call_function``'s value or a
    view of it) which some op at or after it writes in place (through any view) a clone of
    that argument, inserted just before the op, where autograd records the op. Views
    themselves save nothing and read as before, and so do the arguments an op writes itself.
    Returns whether anything changed."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_write: dict = {}
    for n in graph.nodes:
        for _i, value in written_inputs(n):
            base = view_base(value)
            if base.op == "call_function":
                last_write[base] = order[n]
    if not last_write:
        return False
    changed, recorded = False, _recorded(gm)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target in _NOT_SAVED \
                or (node.target in _SCALED and sum(isinstance(a, fx.Node) for a in node.args) < 2) \
                or (returns_view(node) and not written_inputs(node)) or node not in recorded:
            continue
        written = {i for i, _v in written_inputs(node)}
        for i, arg in enumerate(node.args):
            if i in written or not _written_later(arg, order[node], last_write):
                continue
            with graph.inserting_before(node):
                copy = caller(graph, node, [val(arg)])(_aten.clone.default, arg)
            node.update_arg(i, copy)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _recorded(gm: fx.GraphModule) -> set:
    """The nodes autograd records (only they save tensors for backward): a floating-point
    value computed from a trained parameter (the graph's values carry no ``requires_grad``).
    A value read from the inputs alone (an attention mask) is not."""
    out: set = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                p = gm.get_parameter(n.target)
            except AttributeError:
                continue
            if p.requires_grad:
                out.add(n)
        elif n.op == "call_function" and n.target is not _aten.detach.default \
                and _floating(n.meta.get("val")) and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _floating(value) -> bool:
    vals = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in vals)


def _written_later(arg, at: int, last_write: dict) -> bool:
    if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
        return False
    return last_write.get(view_base(arg), -1) >= at
