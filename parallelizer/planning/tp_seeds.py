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

import torch
import torch.fx as fx

from ..analysis.graph_facts import aten, from_constants, is_tensor, prod, same, source_line
from ..analysis.writes import written_args
from ..plan.parallel_plan import DROPOUT_OPS

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


def seed_pairs(sites: list, residual_stop: bool, whole: frozenset = frozenset()) -> dict:
    """column weight FQN -> row weight FQNs its output reaches as their input (walks ending
    at residual adds when ``residual_stop``). The last linears of a sibling branch added to
    a column's output (:func:`_sibling_linears`: LoRA's ``B`` in ``base(h) + B(A(h))``) are
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
    walks = {site.node: set() if residual_stop and _feeds_residual(site.node, is_linear) else
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
        pairs[w] = reached - co_columns - inside
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
    why, when such a walk ends at a norm, an embedding, a router or a conditioning op ('';
    not at a residual add, a block's end): for a model with linears but no pair."""
    is_linear = {s.node: s for s in sites}
    for site in sites:
        ends: list = []
        if _feeds_residual(site.node, is_linear):  # the stream itself: no column (seed_pairs)
            continue
        if not _walk(site.node, is_linear, True, ends=ends) and ends:
            node, why = ends[0]
            where = source_line(node)
            return (f"{site.weight}'s output meets {node.target}"
                    f"{f' at {where}' if where else ''} ({why}) before any other linear")
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
    (:func:`_sibling_linears`) are added to ``siblings``, the conditioning ops it stops at
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
    while frontier and len(seen) < _WALK_LIMIT:
        node = frontier.pop()
        for user in _data_users(node):
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
                if node in normed and not (site.x is node and _ends_block(user, is_linear)):
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
                and _residual_add(user, seen, start, is_linear)
            if residual_stop and residual:
                branch = _sibling_linears(user, node, start, is_linear)
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


def _sibling_linears(add: fx.Node, walked: fx.Node, start: fx.Node, is_linear: dict):
    """The weights of the last linears on ``add``'s other operand when it is a linear map of
    ``start``'s input ``x``: linears, dropout and scalings only between ``x`` and ``add``,
    at least one linear, and nothing ``start`` computed (``base(h) + s * B(A(h))``, LoRA; a
    second projection of the same input). Such an add merges two linear maps of one input,
    not the residual stream, and the walk goes on. None otherwise, a block boundary:
    ``x + f(x)``, a branch through attention or a norm (MobileBERT's bottleneck added to its
    attention output), the block after ``start`` (ELECTRA's projected stream)."""
    x = is_linear[start].x
    other = [a for a in add.args[:2] if isinstance(a, fx.Node) and a is not walked]
    if len(other) != 1 or not isinstance(x, fx.Node):
        return None
    last, todo, seen, linears = set(), [(other[0], True)], set(), False
    while todo:
        n, above = todo.pop()
        if n is x:
            if above:  # a path from x with no linear on it
                return None
            continue
        if (n, above) in seen:
            continue
        seen.add((n, above))
        if len(seen) > _WALK_LIMIT or n is start or n.op != "call_function":
            return None
        if n in is_linear:
            if is_linear[n].weight == is_linear[start].weight:
                return None
            if above:
                last.add(is_linear[n].weight)
            linears = True
            if isinstance(is_linear[n].x, fx.Node):
                todo.append((is_linear[n].x, False))
                continue
            return None
        inputs = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if not is_scaling(n) or len(inputs) != 1:
            return None
        todo.append((inputs[0], above))
    return last if linears and last else None


def is_scaling(node: fx.Node) -> bool:
    """A linear map of its one activation input: dropout, a multiplication or division by a
    constant (a number, a parameter: LoRA's ``scaling``), a cast or a copy."""
    name = str(node.target)
    if name in DROPOUT_OPS and name != "aten.scaled_dot_product_attention.default":
        return True
    if node.target in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar):
        return sum(map(_activation, node.args[:2])) == 1 \
            and (node.target in (aten.mul.Tensor, aten.mul.Scalar) or not _activation(node.args[1]))
    return node.target in (aten._to_copy.default, aten.clone.default, aten.alias.default)


def _activation(a) -> bool:
    return isinstance(a, fx.Node) and not from_constants(a)


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
    return any(isinstance(a, fx.Node) and a is not walked and _same_shape(a.meta.get("val"), out)
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


def _ends_block(node: fx.Node, is_linear: dict) -> bool:
    """``node`` (a linear) or the single-input ops after it (dropout, a scale) feed a
    residual add (:func:`_feeds_residual`): the row of a block's last pair."""
    if _feeds_residual(node, is_linear):
        return True
    seen = {node}
    while True:
        users = [u for u in node.users if u.op == "call_function"]
        if len(users) != 1 or users[0] in is_linear or [
                a for a in users[0].all_input_nodes if is_tensor(a)] != [node]:
            return False
        node = users[0]
        seen.add(node)
        if any(_residual_add(u, seen) for u in node.users if u.op == "call_function"):
            return True


def _feeds_residual(node: fx.Node, is_linear: dict) -> bool:
    """``node``'s value is an operand of a residual add (:func:`_residual_add`) whose other
    operand is independent of it or computed from it through a linear (a block's output,
    ``x + f(x)``), not by elementwise ops alone (GELU's ``x + 0.044715 x^3``)."""
    return any(_residual_add(u, {node}) and not any(
        isinstance(a, fx.Node) and a is not node and _local(a, node, is_linear)
        for a in u.args[:2]) and _sibling_linears(u, node, node, is_linear) is None
        for u in node.users if u.op == "call_function")


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
            todo += [u for u in _data_users(n) if u not in is_linear]
    return False


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


def _residual_add(node: fx.Node, seen: set, start: fx.Node | None = None,
                  is_linear: dict | None = None) -> bool:
    """An add of the walked value to an activation of the same shape that the walk did not
    come from: the residual stream, where a block ends. A walk going on would pair the last
    linear of a block (an output projection whose input the walk of another column took) as
    a column with the next block's linears, a shard that only redistributing the residual
    stream could keep. An operand computed from the walk's ``start`` without a linear on the
    way is no stream, whether or not the walk has reached it yet (minGRU's log-space scan
    ``a + logcumsumexp(b - a)``, both from its gate | hidden projection: the walk, depth
    first, met the add from ``a`` before ``b``'s branch and stopped); one computed through
    a linear is (``x + out_proj(attn) + attn_weights.sum()``: the block's output)."""
    if node.target not in _ADDS:
        return False
    out = node.meta.get("val")
    if start is not None and _wider_than_stream(node, is_linear[start].x):
        return False
    return any(isinstance(a, fx.Node) and a not in seen and a.op != "get_attr"
               and _same_shape(a.meta.get("val"), out) and not from_constants(a)
               and (start is None or not _local(a, start, is_linear)
                    and _stream(a, is_linear))
               for a in node.args[:2])


def _wider_than_stream(add: fx.Node, x) -> bool:
    """``add``'s value has more dims than the block's input ``x`` (the walk's first linear
    reads it), another last dim and another number of elements, and no operand of it is
    what ``x`` is computed from: attention scores ``(B, H, T, T)`` plus a bias computed by a
    linear (a relative-position bias per head), not the residual stream, which a block
    reads. Hyper-connections' ``n`` streams ``(B, S, n, D)``, read flattened ``(B, S, n *
    D)`` (GLM-5's ``attn_hc.fn``), are the stream: a block end."""
    out = add.meta.get("val")
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if getattr(out, "shape", None) is None or getattr(xv, "shape", None) is None \
            or not xv.dim() or out.dim() <= xv.dim() or same(out.shape[-1], xv.shape[-1]) \
            or same(prod(out.shape), prod(xv.shape)):
        return False
    # breadth first from the operands: the stream reaches x in a few ops (a norm, a view)
    todo = [a for a in add.args[:2] if isinstance(a, fx.Node)]
    seen, i = set(todo), 0
    while i < len(todo) and len(seen) < _WALK_LIMIT:
        n, i = todo[i], i + 1
        if n is x:
            return False
        for m in _data_users(n):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return True


_LAYERS = {aten.embedding.default, aten.convolution.default}


def _position_table(n: fx.Node) -> bool:
    """``n`` is an embedding looked up by indices computed from sizes and constants alone
    (positions, relative-position buckets: torchscale's ``RelativePositionBias`` table,
    added to each block's ``(B * heads, T, T)`` scores), not from the model's input values:
    a table of the positions, not a layer's output carrying the tokens."""
    if n.target is not aten.embedding.default or len(n.args) < 2:
        return False
    todo, seen = [n.args[1]], set()
    while todo and len(seen) < _WALK_LIMIT:
        m = todo.pop()
        if not isinstance(m, fx.Node) or m in seen or isinstance(m.meta.get("val"), _SIZES):
            continue
        seen.add(m)
        if m.op == "placeholder":
            return False
        todo += m.all_input_nodes
    return not todo


def _stream(node: fx.Node, is_linear: dict) -> bool:
    """``node`` can be the residual stream: a layer's output (a linear, an embedding of the
    inputs' values or a convolution upstream) or a function of the model's inputs alone (a
    first block reading its input). A value computed elementwise from inputs and trained parameters with no
    layer between (a graph transformer's attention bias ``edge_bias * adj``, of the
    scores' full shape) is not: the walk from q and k goes on through the add to the
    output projection. A search running out of _WALK_LIMIT nodes takes it as the stream."""
    todo, seen, i, weights = [node], {node}, 0, False
    while i < len(todo):
        if len(seen) >= _WALK_LIMIT:
            return True
        n, i = todo[i], i + 1
        if n in is_linear or n.target in _LAYERS and not _position_table(n):
            return True
        weights = weights or n.op == "get_attr"
        for m in n.all_input_nodes:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return not weights


_SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _data_users(node: fx.Node) -> list:
    """``node``'s users but its size queries (``aten.sym_size.int`` and the arithmetic on
    sizes): a size carries none of the values. A walk going through one reached every
    linear whose input a view sized by it (``B, N, D = h.shape`` in a block: the projection
    into the blocks took each block's attention output projection as its row)."""
    users = [u for u in node.users if not isinstance(u.meta.get("val"), _SIZES)]
    return users + [w for u in users for w in _written_roots(u, node) if w not in users]


def _written_roots(op: fx.Node, value: fx.Node) -> list:
    """The tensors ``op`` writes ``value`` into in place, through views, where it is the
    only write (a kv cache filled by ``cache[:b, :t] = k``, read back by later views of the
    cache): their readers read ``value`` from then on. A tensor assembled from several
    written pieces (DeepSeek's ``expand_kv``: the per-head keys and one rope key copied over
    the heads into a ``new_empty``) is left to the pieces' own rules: a walk through it
    would pair the whole rope key's projection too, which no tp splits."""
    return [base for i, base in written_args(op)
            if (op.args[i] if i < len(op.args) else None) is not value
            and _writers(base) == [op]]


def _writers(base: fx.Node) -> list:
    """The in-place ops writing into ``base`` or a view of it."""
    return [n for n in base.graph.nodes if any(b is base for _, b in written_args(n))]


def _same_shape(a, b) -> bool:
    return getattr(a, "shape", None) is not None and getattr(b, "shape", None) is not None \
        and tuple(a.shape) == tuple(b.shape)


def nearest_linears(node: fx.Node, is_linear: dict, upstream: bool = False) -> set:
    """Weights of the linears ``node``'s value reaches going downstream (its users) or
    ``upstream`` (its inputs, parameters skipped) through dropout, scalings and casts only
    (:func:`is_scaling`); empty when some path meets another op first."""
    found, todo, seen = set(), [node], {node}
    while todo and len(seen) < _WALK_LIMIT:
        n = todo.pop()
        for m in (n.all_input_nodes if upstream else _data_users(n)):
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
