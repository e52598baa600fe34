"""The logits an LM head's vocab-parallel shard reaches column for column: what the vocab
planner (``planning/vocab.py``) keeps sharded and the vocab-parallel pass
(``passes/vocab_parallel.py``) rewrites."""
from __future__ import annotations

import torch.fx as fx

from .graph_facts import aten, is_tensor, shape


# ops that keep logits sharded along their last (vocabulary) dim column for column: dtype
# casts, copies, and a scalar scale or softcap (Gemma's tanh(x / c) * c)
_SHARD_KEEPING = {aten.to.dtype, aten._to_copy.default, aten.contiguous.default,
                  aten.clone.default, aten.alias.default, aten.detach.default, aten.tanh.default}
_SCALED = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}


def logits_region(head: fx.Node) -> list[fx.Node]:
    """``head`` (an LM head's logits, sharded along the last dim) and the nodes computed from
    it column for column (:data:`_SHARD_KEEPING`, a multiply or divide by a number, a slice of
    another dim), in graph order: their values are sharded like the head's."""
    region, frontier = {head}, [head]
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u in region or u.op != "call_function" or u.args[0] is not node:
                continue
            keeps = u.target in _SHARD_KEEPING or (
                u.target in _SCALED and len(u.args) == 2 and isinstance(u.args[1], (int, float))) \
                or (u.target is aten.slice.Tensor and is_tensor(u) and len(u.args) > 1
                    and u.args[1] % len(shape(u)) != len(shape(u)) - 1)
            if keeps:
                region.add(u)
                frontier.append(u)
    return [n for n in head.graph.nodes if n in region]
