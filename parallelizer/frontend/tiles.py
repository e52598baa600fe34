"""A tensor tiled by a new outer dim, ``x.unsqueeze(d).expand(..., r, ...)`` merged by a
``reshape`` (or a ``flatten(d, d + 1)``) into dim ``d`` (einops' ``repeat(k, 'b kvh n d ->
b (r kvh) n d')``, how x-transformers and other einops code tile GQA's kv heads), is
``x.repeat`` along ``d``: element ``i * n + j`` is ``x[j]`` either way. Spelled as the
``repeat`` it is, the tensor parallel planner's rule for tiled heads reads it (query head h
reads kv head h % kv); the expand + reshape spelling ended sharding of that attention ("a
(batch, heads) merged dim meets a dim sharded another way"). The new dim inside the original one
(``x[:, :, None].expand(b, kv, r, ...)``, transformers' ``repeat_kv``) is an interleave and
stays as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_rewrite import val

aten = torch.ops.aten
# a flatten is the reshape to its output's shape
_MERGES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default,
           aten.flatten.using_ints}


def tiles_as_repeat(gm: fx.GraphModule) -> int:
    """Rewrite each such unsqueeze + expand + reshape of ``gm`` as ``aten.repeat``; returns
    how many."""
    count = 0
    for node in list(gm.graph.nodes):
        found = _tile(node)
        if found is None:
            continue
        x, d, r = found
        reps = [1] * x.meta["val"].dim()
        reps[d] = r
        with gm.graph.inserting_before(node):
            rep = gm.graph.call_function(aten.repeat.default, (x, reps))
        rep.meta = dict(node.meta)
        node.replace_all_uses_with(rep)
        expand = node.args[0]
        unsqueeze = expand.args[0]
        gm.graph.erase_node(node)
        for n in (expand, unsqueeze):
            if not n.users:
                gm.graph.erase_node(n)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _tile(node: fx.Node):
    """(x, d, r) when ``node`` merges a new outer dim of ``r`` copies into dim ``d`` of
    ``x``, else None."""
    if node.op != "call_function" or node.target not in _MERGES:
        return None
    e = node.args[0]
    if not isinstance(e, fx.Node) or e.target is not aten.expand.default:
        return None
    u = e.args[0]
    if not isinstance(u, fx.Node) or u.target is not aten.unsqueeze.default:
        return None
    x = u.args[0]
    xs, ys, es = _shape(x), _shape(node), _shape(e)
    if xs is None or ys is None or es is None or len(ys) != len(xs) or len(es) != len(xs) + 1:
        return None
    d = u.args[1] % (len(xs) + 1)
    r = es[d]
    if d == len(xs) or not isinstance(r, int) or r < 2:
        return None
    same = _same(es[:d] + es[d + 1:], xs) and _same(ys[:d] + ys[d + 1:], xs[:d] + xs[d + 1:])
    merged = _same([ys[d]], [r * xs[d]])
    return (x, d, r) if same and merged else None


def _shape(n):
    v = val(n)
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def _same(a: list, b: list) -> bool:
    """Equal sizes: the same int, or the same symbolic expression."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else str(x) == str(y)
        for x, y in zip(a, b))
