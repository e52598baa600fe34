"""The residual stream, as the tensor-parallel seeds' walk (planning/tp_seeds.py) tells it
from a block's own activations: the add where a block ends (:func:`residual_add`), the linear
whose output reaches it (:func:`ends_block`), a second linear map of one input merged by an
add (:func:`sibling_linears`, LoRA), and the users of a value that carry its values
(:func:`data_users`). Reads the graph, never changes it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.graph_facts import aten, from_constants, is_tensor, prod, same
from ..analysis.writes import written_args
from ..plan.parallel_plan import DROPOUT_OPS

WALK_LIMIT = 400  # nodes a search visits before it takes what it has
ADDS = {aten.add.Tensor, aten.add_.Tensor}
_PRODUCTS = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
# ops reading a tensor's shape, dtype and device, not its values (timm's drop path draws
# its mask into ``x.new_empty(shape)``)
_SHAPED_BY = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_full.default, aten.empty_like.default, aten.zeros_like.default,
              aten.ones_like.default, aten.full_like.default}


def sibling_linears(add: fx.Node, walked: fx.Node, start: fx.Node, is_linear: dict):
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
        if len(seen) > WALK_LIMIT or n is start or n.op != "call_function":
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


def ends_block(node: fx.Node, is_linear: dict) -> bool:
    """``node`` (a linear) or the single-input ops and products after it (dropout, a scale,
    a layer scale, a drop path's per-sample mask) feed a residual add
    (:func:`feeds_residual`): the row of a block's last pair, whose all-reduced output any
    product then takes whole. timm's EVA multiplies its MLP's output by ``gamma_2`` and a
    drop-path mask: the pair through its in-block norm stopped there, and fc1_g, fc1_x and fc2
    stayed replicated (zoo 17 Z6)."""
    if feeds_residual(node, is_linear):
        return True
    seen = {node}
    while True:
        users = [u for u in node.users if u.op == "call_function" and u.target not in _SHAPED_BY]
        if len(users) != 1 or users[0] in is_linear or [
                a for a in users[0].all_input_nodes if is_tensor(a)] != [node] \
                and users[0].target not in _PRODUCTS:
            return False
        node = users[0]
        seen.add(node)
        if any(residual_add(u, seen) for u in node.users if u.op == "call_function"):
            return True


def feeds_residual(node: fx.Node, is_linear: dict) -> bool:
    """``node``'s value is an operand of a residual add (:func:`residual_add`) whose other
    operand is independent of it or computed from it through a linear (a block's output,
    ``x + f(x)``), not by elementwise ops alone (GELU's ``x + 0.044715 x^3``)."""
    return any(residual_add(u, {node}) and not any(
        isinstance(a, fx.Node) and a is not node and _local(a, node, is_linear)
        for a in u.args[:2]) and sibling_linears(u, node, node, is_linear) is None
        for u in node.users if u.op == "call_function")


def _local(node: fx.Node, source: fx.Node, is_linear: dict) -> bool:
    """``node`` is computed from ``source`` without a linear on the way (searched downstream
    of ``source``, stopping at linears, within WALK_LIMIT nodes)."""
    todo, seen = [source], set()
    while todo and len(seen) < WALK_LIMIT:
        n = todo.pop()
        if n is node:
            return True
        if n not in seen:
            seen.add(n)
            todo += [u for u in data_users(n) if u not in is_linear]
    return False


def residual_add(node: fx.Node, seen: set, start: fx.Node | None = None,
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
    if node.target not in ADDS:
        return False
    out = node.meta.get("val")
    if start is not None and _wider_than_stream(node, is_linear[start].x):
        return False
    return any(isinstance(a, fx.Node) and a not in seen and a.op != "get_attr"
               and same_shape(a.meta.get("val"), out) and not from_constants(a)
               and (start is None or not _local(a, start, is_linear)
                    and not _sibling_branch(a, start, is_linear) and _stream(a, is_linear))
               for a in node.args[:2])


def _sibling_branch(node: fx.Node, start: fx.Node, is_linear: dict) -> bool:
    """``node`` is computed pointwise (an activation, a scale, a gate, dropout) from linears
    of ``start``'s own input: a parallel branch of the same block, not the stream. A block
    adding a second projection of its input to its first (``b(gelu(a(h)) + 0.5 *
    gelu(a0(h)))``, block 0's projection read again in every block: zoo 23 F4) ended its
    walk there, and no pair was found in any block."""
    x = is_linear[start].x
    todo, seen, linears = [node], set(), False
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > WALK_LIMIT or n is start or n.op != "call_function":
            return False
        if n in is_linear:
            if is_linear[n].x is not x:
                return False
            linears = True
            continue
        if torch.Tag.pointwise not in getattr(n.target, "tags", ()) and not is_scaling(n):
            return False
        todo += [a for a in n.all_input_nodes if a.op != "get_attr" and not from_constants(a)]
    return linears


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
    while i < len(todo) and len(seen) < WALK_LIMIT:
        n, i = todo[i], i + 1
        if n is x:
            return False
        for m in data_users(n):
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
    while todo and len(seen) < WALK_LIMIT:
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
    output projection. A search running out of WALK_LIMIT nodes takes it as the stream."""
    todo, seen, i, weights = [node], {node}, 0, False
    while i < len(todo):
        if len(seen) >= WALK_LIMIT:
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


def data_users(node: fx.Node) -> list:
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


def same_shape(a, b) -> bool:
    return getattr(a, "shape", None) is not None and getattr(b, "shape", None) is not None \
        and tuple(a.shape) == tuple(b.shape)
