"""Python numbers read from tensors of constants, folded into the graph.

token-shift-gpt shifts feature chunks along the sequence by ``amts = (2 **
torch.arange(amt)).tolist()`` and ``F.pad(x, (0, 0, amt, -amt))``: torch.export records the
read as ``aten.item`` of a tensor made from constants alone, an unbacked symbol the pads'
sizes are written in. Every run reads the same numbers, but no check of the program on
fake tensors can run a pad of unknown size ("SymIntArrayRef expected to contain only
concrete integers": an internal error at every layout, zoo 18). A scalar read from a tensor
that no input, parameter or buffer reaches is computed once here, on the real tensors of
its constants, and its readers read that number.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
_READS = {aten.item.default, aten._local_scalar_dense.default}


def fold_constant_scalars(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); the number of reads folded. The
    constants' own ops, read by nothing then, are left to the capture's dead-code pass."""
    folded, seen = 0, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _READS \
                or not isinstance(node.args[0], fx.Node):
            continue
        value = _evaluate(node.args[0], seen)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_meta:
            continue
        users = list(node.users)
        node.replace_all_uses_with(value.item())
        gm.graph.erase_node(node)
        _fold_arithmetic(gm.graph, users)
        folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _fold_arithmetic(graph: fx.Graph, nodes: list) -> None:
    """Python arithmetic on the folded numbers (``-amt``, ``2 * amt``: ``operator`` calls
    export records on the symbols) computed too, and so on down its readers."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.op != "call_function" or getattr(n.target, "__module__", None) != "_operator" \
                or any(isinstance(a, fx.Node) for a in n.args) or n.kwargs:
            continue
        users = list(n.users)
        n.replace_all_uses_with(n.target(*n.args))
        graph.erase_node(n)
        todo += users


def _evaluate(node, seen: dict):
    """``node``'s value computed from constants alone, or None: no placeholder, get_attr,
    random or in-place op on the way, and no symbolic size."""
    if not isinstance(node, fx.Node):
        return node if isinstance(node, (int, float, bool, str, torch.dtype, torch.device,
                                         torch.layout, torch.memory_format, type(None))) \
            else _evaluate_all(node, seen)
    if node in seen:
        return seen[node]
    out = None
    op = node.target
    if node.op == "call_function" and op is operator.getitem:  # a piece of unbind / split
        whole, i = _evaluate(node.args[0], seen), node.args[1]
        out = whole[i] if isinstance(whole, (tuple, list)) and isinstance(i, int) else None
    elif node.op == "call_function" and isinstance(op, torch._ops.OpOverload) \
            and not op._schema.is_mutable \
            and torch.Tag.nondeterministic_seeded not in op.tags:
        args = _evaluate_all(node.args, seen)
        kwargs = _evaluate_all(node.kwargs, seen)
        if args is not None and kwargs is not None:
            try:
                out = op(*args, **kwargs)
            except Exception:  # noqa: BLE001 - not computable here: left to the program
                out = None
    seen[node] = out
    return out


def _evaluate_all(values, seen: dict):
    """``values`` (a tuple, list or dict of arguments) evaluated, or None if one cannot be."""
    if isinstance(values, dict):
        out = {k: _evaluate(v, seen) for k, v in values.items()}
        ok = all(v is not None or values[k] is None for k, v in out.items())
        return out if ok else None
    if isinstance(values, (tuple, list)):
        out = [_evaluate(v, seen) for v in values]
        ok = all(v is not None or a is None for v, a in zip(out, values))
        return type(values)(out) if ok else None
    return None
