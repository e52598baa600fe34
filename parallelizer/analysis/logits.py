"""The logits an LM head's vocab-parallel shard reaches column for column: what the vocab
planner (``planning/vocab.py``) keeps sharded and the vocab-parallel pass
(``passes/vocab_parallel.py``) rewrites; and whether a linear produces the logits at all
(:func:`produces_logits`, also read by ``passes/norms_over_projections.py``)."""
from __future__ import annotations

import torch.fx as fx

from .graph_facts import aten, is_tensor, same, shape


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


# products and attention: a value past one of these is no longer the head's logits
_CONTRACTIONS = frozenset({
    aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default,
    aten.matmul.default, aten.baddbmm.default, aten.einsum.default, aten.convolution.default,
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_cudnn_attention.default})
_HEAD_SPLITS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                          aten.unflatten.int})


def produces_logits(linear: fx.Node) -> bool:
    """Whether ``linear``'s output reaches the graph's output (the logits returned, or a loss
    computed from them) with no product or attention between and without its features being
    split into heads (a view to more dims that keeps no dim of their size): the LM head's
    role in the graph. A block's q|k|v, gate or up projection feeds attention or the down
    projection first; its k returned as a cache is viewed into heads."""
    features = shape(linear)[-1] if is_tensor(linear) else -1
    seen, frontier = {linear}, [linear]
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u.op == "output":
                return True
            if u in seen or u.op != "call_function" or u.target in _CONTRACTIONS:
                continue
            if u.target in _HEAD_SPLITS and is_tensor(node) and is_tensor(u) \
                    and len(shape(u)) > len(shape(node)) \
                    and not any(same(d, features) for d in shape(u)):
                continue
            seen.add(u)
            frontier.append(u)
    return False
