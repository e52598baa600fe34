"""Seeds of the tensor-parallel planner (planning/tp.py): the Megatron column/row pairs a
walk over the graph proposes, before sharding propagation checks them.

A linear whose output reaches another linear's input through ops that keep a shard
(elementwise, gating, view, attention over heads) is the column half of a pair and the
reached linear its row half (Megatron-LM §3). A walk ends at a block's boundary: a residual
add, a LayerNorm over all the walked features, an embedding, a mixture-of-experts router's
top-k, and a conditioning broadcast: a linear's per-sample features scaling or shifting
every position of another activation (DiT's adaLN ``x * (1 + scale.unsqueeze(1)) + shift``,
FiLM). A linear whose output is the residual stream itself (a projection of the embeddings
into the blocks' width) seeds nothing. Reads the graph, never changes it.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import aten

_STOP = {aten.embedding.default}
# A LayerNorm over the walked value's whole features (a block's input norm) ends the walk; one
# over a part of them (StableLM's per-head q/k LayerNorm over head_dim) is inside the pair
_NORMS = {aten.native_layer_norm.default, aten.layer_norm.default}
# A mixture-of-experts router (Mixtral's and Qwen2-MoE's ``mlp.gate``) picks experts with
# top-k over all its logits, so it stays replicated: a walk reaching top-k pairs nothing
# (else it went on through the combine and the residual into the next block's q/k/v and
# took them as its rows, leaving that attention replicated).
_ROUTING = {aten.topk.default}
_WALK_LIMIT = 400
_ADDS = {aten.add.Tensor, aten.add_.Tensor}
_ELEMENTWISE = _ADDS | {aten.mul.Tensor, aten.mul_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
                        aten.div.Tensor, aten.div_.Tensor}


def seed_pairs(sites: list, residual_stop: bool) -> dict:
    """column weight FQN -> row weight FQNs its output reaches as their input (walks ending
    at residual adds when ``residual_stop``)."""
    pairs, taken = {}, set()
    is_linear = {s.node: s for s in sites}
    for site in sites:
        w = site.weight
        if w in taken:
            pairs[w] = set()
            continue
        # one output feature (Qwen2-MoE's shared_expert_gate): nothing to shard; an output
        # that is itself the residual stream (ELECTRA's embeddings_project, added to the first
        # block's attention output) is no column: a shard of it would have to be gathered
        # for the stream, and the linears it feeds would lose their own pairs
        reached = set() if _out_features(site) == 1 or residual_stop and _feeds_residual(
            site.node, is_linear) else _walk(site.node, is_linear, residual_stop)
        pairs[w] = reached
        taken |= reached
    return pairs


def _out_features(site) -> int | None:
    val = site.node.meta.get("val")
    return int(val.shape[-1]) if val is not None and val.dim() else None


def _walk(start: fx.Node, is_linear: dict, residual_stop: bool) -> set:
    seen, frontier, reached = {start}, [start], set()
    while frontier and len(seen) < _WALK_LIMIT:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            if user.target in _ROUTING:
                return set()
            seen.add(user)
            if user in is_linear:
                if is_linear[user].x is node:
                    reached.add(is_linear[user].weight)
                continue
            if user.target in _NORMS and _whole_features(user, start):
                continue
            if user.target not in _STOP and not (residual_stop and _residual_add(user, seen)) \
                    and not _conditioning(user, node):
                frontier.append(user)
    return reached


def _conditioning(op: fx.Node, walked: fx.Node) -> bool:
    """``op`` scales or shifts another activation by the walked value broadcast over its
    positions: the walked value has the output's features (last dim) but size 1 (or no dim)
    where the output has more, and the other operand is an activation of the output's shape.
    The walk then goes on only from that operand, when it reaches it (``t - t.mean(1,
    keepdim=True)`` still passes through ``t``). DiT's adaLN-Zero (``Linear(h, 6h)`` of the timestep
    and class embedding, ``.chunk(6)``, ``x * (1 + scale.unsqueeze(1)) + shift``) and FiLM:
    a per-sample vector conditioning every token. Going on would pair the conditioning
    linear, as a column, with the block's q/k/v and fc1 as its rows (computed on a
    feature-sharded input, all-reduced), leaving attention and the MLP's output projection
    replicated; the conditioning linear's output is one row per sample, not per token."""
    if op.target not in _ELEMENTWISE:
        return False
    v, out = walked.meta.get("val"), op.meta.get("val")
    if getattr(v, "shape", None) is None or getattr(out, "shape", None) is None \
            or not v.dim() or not out.dim() or v.dim() > out.dim():
        return False
    vs, os_ = tuple(v.shape), tuple(out.shape)
    if not (isinstance(vs[-1], int) and isinstance(os_[-1], int) and vs[-1] == os_[-1] > 1):
        return False
    lead = (1,) * (len(os_) - len(vs)) + vs
    if not any(isinstance(a, int) and a == 1 and not (isinstance(b, int) and b == 1)
               for a, b in zip(lead[:-1], os_[:-1])):
        return False
    return any(isinstance(a, fx.Node) and a is not walked and _same_shape(a.meta.get("val"), out)
               and not _constant(a) for a in op.args[:2])


def _feeds_residual(node: fx.Node, is_linear: dict) -> bool:
    """``node``'s value is an operand of a residual add (:func:`_residual_add`) whose other
    operand is independent of it or computed from it through a linear (a block's output,
    ``x + f(x)``), not by elementwise ops alone (GELU's ``x + 0.044715 x^3``)."""
    return any(_residual_add(u, {node}) and not any(
        isinstance(a, fx.Node) and a is not node and _local(a, node, is_linear)
        for a in u.args[:2]) for u in node.users if u.op == "call_function")


def _local(node: fx.Node, source: fx.Node, is_linear: dict) -> bool:
    """``node`` is computed from ``source`` without a linear on the way (searched downstream
    of ``source``, stopping at linears, within _WALK_LIMIT nodes)."""
    todo, seen = [source], set()
    while todo and len(seen) < _WALK_LIMIT:
        n = todo.pop()
        if n is node:
            return True
        if n not in seen:
            seen.add(n)
            todo += [u for u in n.users if u not in is_linear]
    return False


def _whole_features(norm: fx.Node, start: fx.Node) -> bool:
    """``norm`` normalises as many features as ``start`` (a linear) outputs, or more."""
    x, out = norm.args[0].meta.get("val"), start.meta.get("val")
    if x is None or out is None or not x.dim() or not out.dim():
        return True
    return x.shape[-1] == out.shape[-1] or not (out.shape[-1] % x.shape[-1] == 0)


def _residual_add(node: fx.Node, seen: set) -> bool:
    """An add of the walked value to an activation of the same shape that the walk did not
    come from: the residual stream, where a block ends. A walk going on would pair the last
    linear of a block (an output projection whose input the walk of another column took) as
    a column with the next block's linears, a shard that only redistributing the residual
    stream could keep."""
    if node.target not in _ADDS:
        return False
    out = node.meta.get("val")
    return any(isinstance(a, fx.Node) and a not in seen and a.op != "get_attr"
               and _same_shape(a.meta.get("val"), out) and not _constant(a)
               for a in node.args[:2])


def _same_shape(a, b) -> bool:
    return getattr(a, "shape", None) is not None and getattr(b, "shape", None) is not None \
        and tuple(a.shape) == tuple(b.shape)


def _constant(node: fx.Node) -> bool:
    """Computed from parameters, buffers and constants alone (no placeholder upstream)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return False
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return True
