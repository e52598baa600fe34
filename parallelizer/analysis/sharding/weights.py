"""Placements along a linear's *weight path* (issue 23, part 4): the casts, same-shape views
and transposes a weight or bias goes through between its get_attr and the product
(``F.linear(x, w.to(x.dtype))``, ``x @ w.float().T``, ``F.linear(x, w.t())`` of a weight
stored (in, out); :func:`parallelizer.analysis.linears.weight_source`), and a buffer it is
multiplied by at its own shape (a pruning mask, :func:`parallelizer.analysis.linears.mask_of`),
which holds the parameter's shard.

Each node of the path holds the parameter's shard: the dim the plan shards (output
features of a column_parallel weight and its bias, input features of a row_parallel one)
follows the transposes, and a view's int size on that dim becomes the local size (the
layout's local length for a fused or replicated-heads column weight). The linear's own rule
(:func:`parallelizer.analysis.sharding.linear_rule.linear_rule`) reads the product as a whole, so
the path never meets the activation rules (a ``type_as(w, x)`` does not ask what ``x`` is).
A static piece of the parameter on the path (``in_proj_weight.split([E, 2E])[1]``) has its
sizes made local by :mod:`.pieces`.
"""
from __future__ import annotations

import torch.fx as fx

from ...plan.layouts import local_length
from ..graph_facts import aten, expr, is_tensor, shape
from ..linears import (VIEWS, Linear, bias_operand, mask_of, mask_read, merge_point, path_source,
                       permutation, piece, weight_path)
from .pieces import piece_rule, site_key
from .placements import REPLICATE, PerOutput, Shard, shard_dim
from .state import add_rewrite, dim_of, placement

_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default,
               aten.mT.default}


def weight_paths(site: Linear, column, row) -> dict:
    """node name -> (parameter dim the plan shards or None, column weight or None, the key
    of the layout its sizes follow) for every node on the weight and bias paths of
    ``site``: the parameter's own up to a piece of it (:mod:`.pieces`), the linear's key
    after."""
    w = site.weight
    owner = w if w in column else None
    dim = site.out_dim if w in column else site.in_dim if w in row else None
    out = _entries(site.w_node, dim, owner, w, site_key(site))
    bias = bias_operand(site)
    if bias is not None:
        out.update(_entries(bias, 0 if owner else None, owner, site.bias, site_key(site)))
    return out


def _entries(operand, dim, owner, param: str, key: str) -> dict:
    out, at = {}, param
    for n in weight_path(operand):
        out[n.name] = (dim, owner, at)
        mask = mask_of(n)
        for m in mask_read(mask) if mask is not None else ():  # cut as the parameter is
            out[m.name] = (dim, owner, at)
        if piece(n) is not None:
            at = key
    if at == param:  # read whole: the linear's layout is the parameter's
        out = {name: (d, o, key) for name, (d, o, _k) in out.items()}
    return out


def path_rule(node: fx.Node, prop, tp: int, entry: tuple):
    """(placement, groups) of one weight-path node (see the module docstring)."""
    dim, owner, key = entry
    groups = frozenset({owner}) if owner else frozenset()
    if node.op == "get_attr":  # a mask (linears.mask_of): the parameter's shard
        return (REPLICATE, frozenset()) if dim is None else (Shard(dim), groups)
    src = path_source(node)
    p = placement(prop, src)
    if src.op == "get_attr":
        d = dim
    elif isinstance(p, PerOutput):  # a getitem of a split of the parameter
        d = shard_dim(p[node.args[1]])
    else:
        d = dim_of(prop, src)
    if src.name in prop.raw:
        prop.raw[node.name] = prop.raw[src.name]
    elif owner and dim == 0 and is_tensor(node) \
            and tuple(shape(node)) == (prop.features.get(key),):
        # a column bias holds the linear's output features in their order: a slice of it
        # beside the path (Swin-V2's ``b = bias.clone(); b[C:2 * C].zero_()``) cuts those
        # features as a slice of the output would
        prop.raw[node.name] = frozenset({key})
    if d is None:
        return REPLICATE, frozenset()
    cut = piece_rule(node, prop, tp, d, key, groups)
    if cut is not None:
        return cut, groups
    if node.target in _TRANSPOSES:  # of a merged parameter's dims before its view, or 2-D
        perm = permutation(node)
        return Shard(perm.index(d) if perm is not None else 1 - d), groups
    if node.target in VIEWS:
        k = merge_point(shape(src), shape(node))
        if k is not None:  # a parameter's dims merged into the 2-D weight: the shard's group
            d = 0 if d == 0 else 1 if d == k else None
            if d is None:
                return REPLICATE, frozenset()
        sizes = list(node.args[1])
        if isinstance(sizes[d], int) and sizes[d] != -1:
            add_rewrite(prop, node, 1, d, _local(prop, key, int(expr(shape(node)[d])), tp))
    return Shard(d), groups


def _local(prop, key, n: int, tp: int) -> int:
    layout = prop.layouts.get(key)
    try:
        return local_length(n, layout, tp)
    except ValueError:  # a layout of another size: the constraints report it
        return n // tp
