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

from ..analysis.graph_facts import aten, from_constants, prod, same, source_line
from .residual_stream import (ADDS, WALK_LIMIT, data_users, ends_block, feeds_residual, is_scaling,
                              residual_add, same_shape, sibling_linears)

_STOP = {aten.embedding.default}
# A LayerNorm over the walked value's whole features (a block's input norm) ends the walk; one
# over a part of them (StableLM's per-head q/k LayerNorm over head_dim) is inside the pair
_NORMS = {aten.native_layer_norm.default, aten.layer_norm.default}
# A mixture-of-experts router (Mixtral's and Qwen2-MoE's ``mlp.gate``) picks experts with
# top-k over all its logits, so it stays replicated: a walk reaching top-k pairs nothing
# (else it went on through the combine and the residual into the next block's q/k/v and
# took them as its rows, leaving that attention replicated).
_ROUTING = {aten.topk.default}
# why a linear whose weight forward computes pairs with nothing: no refusal leaves it unsaid
COMPUTED_WEIGHTS = ("a weight computed in forward (torch.nn.utils.parametrizations: "
                    "weight_norm, spectral_norm) is no parameter operand")
_ELEMENTWISE = ADDS | {aten.mul.Tensor, aten.mul_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
                       aten.div.Tensor, aten.div_.Tensor}


def seed_pairs(sites: list, residual_stop: bool, whole: frozenset = frozenset()) -> dict:
    """column weight FQN -> row weight FQNs its output reaches as their input (walks ending
    at residual adds when ``residual_stop``). The last linears of a sibling branch added to
    a column's output (:func:`sibling_linears`: LoRA's ``B`` in ``base(h) + B(A(h))``) are
    columns with the same rows, never rows themselves; what feeds them (``A``) pairs
    nothing and stays replicated: the sum of linear maps of one input is sharded as one.
    ``whole``: weights kept whole (:func:`chain_heads`), neither column nor row."""
    is_linear = {s.node: s for s in sites}
    siblings: dict = {}
    # every walk first, so that no walk takes a sibling as its row, in any order; an output
    # that is itself the residual stream (ELECTRA's embeddings_project, added to the first
    # block's attention output) walks nothing: it is no column, since a shard of it would
    # have to be gathered for the stream and the linears it feeds would lose their pairs
    inside: set = set()  # linears within a pair (:func:`_within_pair`): no column, no row
    walks = {site.node: set() if residual_stop and feeds_residual(site.node, is_linear) else
             _walk(site.node, is_linear, residual_stop, siblings.setdefault(site.weight, set()),
                   inside=inside)
             for site in sites}
    co_columns = {w for ws in siblings.values() for w in ws}
    pairs, taken = {}, set(co_columns) | inside
    for site in sites:
        w = site.weight
        walks[site.node] = set() if w in whole else walks[site.node] - whole
        if w in taken:
            pairs[w] = set()
            continue
        # one output feature (Qwen2-MoE's shared_expert_gate): nothing to shard
        reached = set() if _out_features(site) == 1 else walks[site.node]
        # a linear called twice pairs with what each call reaches: a0 in ``b0(a0(x))`` and
        # ``b1(a1(y) + a0(y))`` lost b0 to its second call, and b0, a row no column then
        # reached, took every pair with it (zoo 23 F4)
        pairs[w] = pairs.get(w, set()) | (reached - co_columns - inside)
        taken |= reached
    for w, ws in siblings.items():
        for sibling in ws:
            if pairs.get(w) and sibling != w:
                pairs[sibling] = pairs[sibling] | pairs[w]
    return pairs


def chain_heads(sites: list, pairs: dict) -> frozenset:
    """Column weights of ``pairs`` one of whose rows, walked as a column itself, reaches
    rows of its own: the head of a chain of linears within a block (a low-rank projection,
    DeepSeek's MLA ``q_a -> norm -> q_b -> heads -> attention -> o``). Paired first, the
    head shards the chain's small rank and its row's output is summed over tp before
    attention, which every rank then computes whole; kept whole, its row is the column over
    heads and the chain's end the row (planning/tp_chains.py weighs the two)."""
    is_linear = {s.node: s for s in sites}
    by_weight = {s.weight: s for s in sites}
    return frozenset(c for c, rows in pairs.items() if any(
        r in by_weight and _walk(by_weight[r].node, is_linear, True) - {c} for r in rows))


def first_end(sites: list) -> str:
    """Where the first linear's walk (graph order) that reaches no other linear ends and
    why, when such a walk ends at a norm, an embedding, a router or a conditioning op; else,
    where a linear reaches another only past a residual add (a block's end: ``x + a(x)``
    then ``x + b(x)``), that; else '': for a model with linears but no pair."""
    is_linear = {s.node: s for s in sites}
    for site in sites:
        ends: list = []
        if feeds_residual(site.node, is_linear):  # the stream itself: no column (seed_pairs)
            continue
        if not _walk(site.node, is_linear, True, ends=ends) and ends:
            node, why = ends[0]
            where = source_line(node)
            return (f"{site.weight}'s output meets {node.target}"
                    f"{f' at {where}' if where else ''} ({why}) before any other linear")
    for site in sites:
        past = not _walk(site.node, is_linear, True) and _walk(site.node, is_linear, False)
        if past:
            return (f"each linear's output meets a residual add (a block's end) before any "
                    f"other linear: {site.weight}'s reaches {min(past)} only past one; "
                    f"{COMPUTED_WEIGHTS}")
    return ""


def _within_pair(site, start: fx.Node) -> bool:
    """``site`` (a 2-D weight) reads all of ``start``'s output values but contracts another
    dim than the walked features: a part of them that a view split into more dims
    (``rel(h).view(B, T, H, d) @ P``, one P for every head) or a dim a transpose put last
    (Linformer's ``E(k.transpose(1, 2))`` over the sequence). A product within the pair,
    not a row; the rows are further on (propagation keeps the shard of the dim it does not
    contract: analysis/sharding/propagate.py ``_uncontracted``). A linear reading a part of
    the values (DeepSeek's ``kv_b_proj`` on one part of ``kv_a``'s split) is a row."""
    x, out = site.x.meta.get("val") if isinstance(site.x, fx.Node) else None, start.meta.get("val")
    if site.batched or site.merged is not None or getattr(x, "shape", None) is None \
            or getattr(out, "shape", None) is None or not out.dim():
        return False
    return x.dim() >= out.dim() and not same(x.shape[-1], out.shape[-1]) \
        and same(prod(x.shape), prod(out.shape))


def _out_features(site) -> int | None:
    val = site.node.meta.get("val")
    return int(val.shape[-1]) if val is not None and val.dim() else None


def _walk(start: fx.Node, is_linear: dict, residual_stop: bool, siblings=None,
          conditioned=None, ends=None, inside=None) -> set:
    """Row weights ``start``'s output reaches; the weights of sibling branches it passes
    (:func:`sibling_linears`) are added to ``siblings``, the conditioning ops it stops at
    (:func:`_conditioning`) to ``conditioned``, each op that ends a path to ``ends`` (a
    list of (node, why)), the linears within the pair it passes (:func:`_within_pair`) to
    ``inside``."""
    seen, frontier, reached = {start}, [start], set()
    siblings = set() if siblings is None else siblings
    conditioned = set() if conditioned is None else conditioned
    ends = [] if ends is None else ends
    # past a norm or the residual stream the walked features are no longer what a product
    # along another dim is measured against (MLP-Mixer's channel MLP after the token one)
    crossed: set = set()
    normed: dict = {}  # node -> the norm within the block it is computed from, and why
    while frontier and len(seen) < WALK_LIMIT:
        node = frontier.pop()
        for user in data_users(node):
            if user in seen or user.op != "call_function":
                continue
            if user.target in _ROUTING and _over_features(user, start):
                ends.append((user, "a mixture-of-experts router's top-k"))
                return set()
            seen.add(user)
            if user in is_linear:
                # E linears side by side pair with E linears side by side only: a row reads
                # its expert's columns (a 2-D column reaching one through a dispatch einsum,
                # Soft MoE's, put its features on the experts' slots: nothing paired)
                site = is_linear[user]
                if node in normed and not (site.x is node and ends_block(user, is_linear)):
                    ends.append(normed[node])
                    continue
                if site.x is node and node not in crossed and _within_pair(site, start):
                    if inside is not None:
                        inside.add(site.weight)
                    frontier.append(user)
                    continue
                if site.x is node and site.batched == is_linear[start].batched:
                    reached.add(site.weight)
                continue
            if user.target in _NORMS and _whole_features(user, start):
                why = (user, "a LayerNorm over all its features, which ends a pair as a "
                             "block's input norm does")
                if not residual_stop or node in crossed or node in normed:
                    ends.append(why)
                    continue
                # a norm within the block (Magneto's sub-LN before out_proj): the pair goes
                # on to a row that ends the block; the norm is computed whole, gathered
                normed[user] = why
                crossed.add(user)
                frontier.append(user)
                continue
            if node in normed:
                normed[user] = normed[node]
            if user.target in _STOP:
                ends.append((user, "an embedding"))
                continue
            if _conditioning(user, node) and _one_row_per_sample(start):
                conditioned.add(user)
                ends.append((user, "a per-sample conditioning broadcast"))
                continue
            # past a crossing the answer matters only where the stream stops the walk
            residual = (residual_stop or (node not in crossed and user.target not in _NORMS)) \
                and residual_add(user, seen, start, is_linear)
            if residual_stop and residual:
                branch = sibling_linears(user, node, start, is_linear)
                if branch is None:  # a block's end: no reason worth naming
                    continue
                siblings |= branch
            if node in crossed or user.target in _NORMS or residual:
                crossed.add(user)
            frontier.append(user)
    return reached


def _over_features(topk: fx.Node, start: fx.Node) -> bool:
    """``topk`` picks along a dim as wide as ``start``'s output features (a router's experts,
    read from its logits); a top-k over attention scores' keys (x-transformers'
    ``attn_sparse_topk``) picks within each head, whose q and k pair as any attention's
    (they were reported "no column/row pair found", zoo 13 Z14)."""
    x, out = topk.args[0].meta.get("val"), start.meta.get("val")
    if getattr(x, "shape", None) is None or getattr(out, "shape", None) is None \
            or not x.dim() or not out.dim():
        return True
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    return same(x.shape[dim], out.shape[-1])


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
    replicated; the conditioning linear's output is one row per sample, not per token. A
    value broadcast over the batch (dim 0) is one for every sample, no conditioning (a
    position bias per head from an MLP, x-transformers' ``dynamic_pos_bias``)."""
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
    if _broadcast(lead[0], os_[0]):
        return False
    if not any(_broadcast(a, b) for a, b in zip(lead[:-1], os_[:-1])):
        return False
    return any(isinstance(a, fx.Node) and a is not walked and same_shape(a.meta.get("val"), out)
               and not from_constants(a) for a in op.args[:2])


def _broadcast(a, b) -> bool:
    """Size ``a`` broadcasts to ``b``: 1 where ``b`` is more."""
    return isinstance(a, int) and a == 1 and not (isinstance(b, int) and b == 1)


def _one_row_per_sample(linear: fx.Node) -> bool:
    """``linear``'s output is one row per sample ((B, F) or (B, 1, F)), as a conditioning
    linear's is: Mamba's ``dt_proj``, one row per position (B, L, E), whose output a
    selective scan broadcasts over a dim of its own (``dBx.unsqueeze(1)`` against (B, t, s,
    E, N)), is no conditioning vector (it was kept whole as one)."""
    v = linear.meta.get("val")
    return getattr(v, "shape", None) is not None and v.dim() >= 1 and all(
        isinstance(s, int) and s == 1 for s in v.shape[1:-1])


def _whole_features(norm: fx.Node, start: fx.Node) -> bool:
    """``norm`` normalises as many features as ``start`` (a linear) outputs, or more, or a
    value of ``start``'s rank: a part of a fused output whole (the GRU-gated residual's z of
    ``sigmoid(gates(..)).chunk(2)``, x-transformers, then the MLP's pre-norm), where a
    per-head norm reads the heads split out into a dim of their own."""
    x, out = norm.args[0].meta.get("val"), start.meta.get("val")
    if x is None or out is None or not x.dim() or not out.dim():
        return True
    return x.shape[-1] == out.shape[-1] or not (out.shape[-1] % x.shape[-1] == 0) \
        or x.dim() == out.dim()


def nearest_linears(node: fx.Node, is_linear: dict, upstream: bool = False) -> set:
    """Weights of the linears ``node``'s value reaches going downstream (its users) or
    ``upstream`` (its inputs, parameters skipped) through dropout, scalings and casts only
    (:func:`is_scaling`); empty when some path meets another op first."""
    found, todo, seen = set(), [node], {node}
    while todo and len(seen) < WALK_LIMIT:
        n = todo.pop()
        for m in (n.all_input_nodes if upstream else data_users(n)):
            if m in seen or m.op == "get_attr":
                continue
            seen.add(m)
            if m in is_linear:
                found.add(is_linear[m].weight)
            elif m.op == "call_function" and is_scaling(m):
                todo.append(m)
            else:
                return set()
    return found


def linears_feeding(x: fx.Node, is_linear: dict) -> set:
    """Weights of the linears whose output is ``x``, or reaches it through dropout,
    scalings and casts only; empty otherwise."""
    if x in is_linear:
        return {is_linear[x].weight}
    if x.op == "call_function" and is_scaling(x):
        return nearest_linears(x, is_linear, upstream=True)
    return set()


def conditioning_ops(node: fx.Node, is_linear: dict) -> set:
    """The conditioning broadcasts (:func:`_conditioning`) the walk from the linear ``node``
    stops at: non-empty for DiT's adaLN and FiLM linears, which pair with nothing."""
    found: set = set()
    _walk(node, is_linear, True, conditioned=found)
    return found
