"""Placements along a linear's *weight path* (issue 23, part 4): the casts, same-shape views
and transposes a weight or bias goes through between its get_attr and the product
(``F.linear(x, w.to(x.dtype))``, ``x @ w.float().T``, ``F.linear(x, w.t())`` of a weight
stored (in, out); :func:`parallelizer.analysis.graph_facts.weight_source`).

Each node of the path holds the parameter's shard: the dim the plan shards (output
features of a column_parallel weight and its bias, input features of a row_parallel one)
follows the transposes, and a view's int size on that dim becomes the local size (the
layout's local length for a fused or replicated-heads column weight). The linear's own rule
(:func:`parallelizer.analysis.sharding.propagate._linear`) reads the product as a whole, so
the path never meets the activation rules (a ``type_as(w, x)`` does not ask what ``x`` is).
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ...plan.layouts import local_length
from ..graph_facts import VIEWS, Linear, aten, expr, shape, weight_path
from .placements import REPLICATE, Shard
from .state import add_rewrite, dim_of

_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default,
               aten.mT.default}


def _bias_operand(site: Linear) -> Optional[fx.Node]:
    """The node the linear (or its separate bias add) reads the bias through."""
    n = site.node
    if site.bias_add is not None:
        a, b = site.bias_add.args
        return b if a is n else a
    if site.bias is None:
        return None
    return n.args[2] if n.target is aten.linear.default else n.args[0]


def weight_paths(site: Linear, column, row) -> dict:
    """node name -> (parameter dim the plan shards or None, column weight or None) for
    every node on the weight and bias paths of ``site``."""
    w = site.weight
    owner = w if w in column else None
    dim = site.out_dim if w in column else site.in_dim if w in row else None
    out = {n.name: (dim, owner) for n in weight_path(site.w_node)}
    bias = _bias_operand(site)
    if bias is not None:
        out.update({n.name: (0 if owner else None, owner) for n in weight_path(bias)})
    return out


def path_rule(node: fx.Node, prop, tp: int, entry: tuple):
    """(placement, groups) of one weight-path node (see the module docstring)."""
    dim, owner = entry
    src = node.args[0]
    d = dim if src.op == "get_attr" else dim_of(prop, src)
    groups = frozenset({owner}) if owner else frozenset()
    if src.name in prop.raw:
        prop.raw[node.name] = prop.raw[src.name]
    if d is None:
        return REPLICATE, frozenset()
    if node.target in _TRANSPOSES:
        return Shard(1 - d), groups
    if node.target in VIEWS:
        sizes = list(node.args[1])
        if isinstance(sizes[d], int) and sizes[d] != -1:
            add_rewrite(prop, node, 1, d, _local(prop, owner, int(expr(shape(node)[d])), tp))
    return Shard(d), groups


def _local(prop, owner, n: int, tp: int) -> int:
    layout = prop.layouts.get(owner) if owner else None
    try:
        return local_length(n, layout, tp)
    except ValueError:  # a layout of another size: the constraints report it
        return n // tp
