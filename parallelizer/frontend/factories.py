"""Factories shaped like a constant, spelled with the constant's shape.

``torch.zeros_like(self.cache_k)`` of a tensor the module holds (not a parameter: a kv cache
reset every call, Meta's Llama 3 reference with the reset its carried-state refusal asks
for) is ``torch.zeros(shape, dtype=..., device=...)`` of that tensor's shape: the same
values, but a factory whose size the tensor-parallel planner can make local when a sharded
value is written into it (``analysis/sharding/heads.request_written``: the cache then holds
the rank's kv heads instead of gathering them). Read through ``_like``, its size was the
constant's, which no rank holds a piece of.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_rewrite import val

aten = torch.ops.aten
_AS = {aten.zeros_like.default: aten.zeros.default, aten.ones_like.default: aten.ones.default}
_KWARGS = {"dtype", "layout", "device", "pin_memory", "memory_format"}


def factories_of_constants(gm: fx.GraphModule) -> int:
    """Rewrite ``zeros_like(c)`` / ``ones_like(c)`` of a constant ``c`` (a get_attr that is no
    parameter) with a static shape into ``zeros(c.shape)`` / ``ones(c.shape)`` of its dtype,
    layout and device. Returns how many."""
    params = {name for name, _ in gm.named_parameters()}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _AS or len(node.args) != 1:
            continue
        c, v = node.args[0], val(node)
        if not isinstance(c, fx.Node) or c.op != "get_attr" or c.target in params \
                or not isinstance(v, torch.Tensor) or set(node.kwargs) - _KWARGS \
                or node.kwargs.get("memory_format") not in (None, torch.preserve_format) \
                or not all(isinstance(d, int) for d in v.shape):
            continue
        node.target = _AS[node.target]
        node.args = (list(v.shape),)
        node.kwargs = {"dtype": v.dtype, "layout": v.layout, "device": v.device,
                       "pin_memory": False}
        done += 1
    if done:  # the constant, read by nothing now, goes with capture's dead code
        gm.graph.lint()
        gm.recompile()
    return done
