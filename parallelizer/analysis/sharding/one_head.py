"""Multi-query attention's one kv head, copied to every tp rank: the parts of a fused
column output that are one head (GPTBigCode's ``c_attn(x).unsqueeze(1).split((E, D, D),
dim=3)``; PaLM's k and v parts with no heads dim, read by einsum or, after rotary
embeddings, by matmuls that broadcast them against the query heads) and a separate one-head
projection unsqueezed to (B, 1, T, D). Split evenly, their shard would land on head_dim,
which attention takes only gathered; copied (``replicated_heads(1, D)``), every rank holds
the whole head and computes its own query heads against it. See
:mod:`parallelizer.analysis.sharding.propagate` for the whole picture."""
from __future__ import annotations

import operator

import torch

from ...plan.layouts import ReplicatedHeads
from ..graph_facts import aten, from_constants, same, shape
from ..linears import full_slice, reads_parameters
from .einsum_read import einsum_letters
from .placements import Shard
from .state import HeadsMark, dim_of, record_use


def copied_parts(node, prop, d: int, raw) -> dict:
    """The parts of a split of a column output's features (along ``d``) that are one kv head
    each: GPTBigCode's multi-query ``c_attn(x).unsqueeze(1).split((E, D, D), dim=3)``, whose
    k and v parts keep a dim of size 1 that repeat_kv's expand (or SDPA's ``enable_gqa``)
    then spreads over the query heads. Split evenly, their shard would land on head_dim,
    which attention takes only gathered; as one copied head (``replicated_heads(1, D)``)
    every rank holds the whole part, placed on that size-1 dim. Returns {part index: that
    dim}; empty when every part would be copied (no query heads left to split) or a previous
    run refused copies of ``raw`` (they reached an op other than attention's kv spread)."""
    if raw & prop.no_replication or node.target is not aten.split_with_sizes.default:
        return {}
    ins = shape(node.args[0])
    ones = [j for j in range(len(ins)) if j != d and same(ins[j], 1)]
    taken = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    out = {}
    for i, value in taken.items():
        h = next((j for j in ones if _spread_over_heads(value, j)), None)
        if h is not None:
            out[i] = h
        elif d == len(shape(value)) - 1 and _held_whole(value):
            out[i] = None  # held whole: analysis/sharding/placements.CopiedWhole
    return out if len(out) < len(node.meta["val"]) else {}


def _broadcast_by_einsum(u, value) -> bool:
    """``u`` is an einsum that broadcasts ``value`` over a letter it lacks and an activation
    operand and the output have: one k or v head with no heads dim, against the query heads
    (PaLM's multi-query ``einsum('bhid,bjd->bhij', q, k)``, Chowdhery et al. 2022 §2)."""
    if u.target is not aten.einsum.default or not isinstance(u.args[0], str):
        return False
    ops = list(u.args[1])
    if sum(o is value for o in ops) != 1:
        return False
    read = einsum_letters(u.args[0], [len(shape(o)) for o in ops])
    if read is None:
        return False
    spelled, out = read
    mine = spelled[ops.index(value)]
    others = {c for o, ls in zip(ops, spelled) if o is not value and not from_constants(o)
              for c in ls}
    return bool((set(out) & others) - set(mine))


def _held_whole(value, depth: int = 32, root=None, held=None) -> bool:
    """Every use of ``value`` (one head with no heads dim, its features the last dim) reads
    it, shaped as the part, as one head against the query heads: an einsum broadcasting it
    over them (:func:`_broadcast_by_einsum`), or an unsqueeze whose new size-1 dim is spread
    over them (PaLM written for SDPA: ``k.unsqueeze(1).expand(b, heads, n, head_dim)``),
    maybe after ops that compute from the head alone (rotary embeddings with their tables,
    rotate_half's chunks or its ``(d r)`` view, unbind and stack, ``cat``:
    :func:`carries_copied_whole`). Such a part is one head, whole on every rank. ``root``:
    where the walk began (default ``value``); ``held``: the values found so already."""
    root = value if root is None else root
    held = set() if held is None else held
    if value in held:
        return True
    if depth == 0 or not value.users:
        return False
    for u in value.users:
        if u.meta.get("val") is None or isinstance(u.meta.get("val"), (int, torch.SymInt)):
            continue  # a size query or a metadata assertion reads no value
        # read as the head: a value shaped as the part (a view into heads is no one head)
        head = isinstance(value.meta.get("val"), torch.Tensor) and shape(value) == shape(root)
        if u.target is aten.unsqueeze.default and u.args[0] is value:
            ok = head and _spread_over_heads(u, u.args[1] % (len(shape(value)) + 1))
        elif u.target is aten.einsum.default:
            ok = head and _broadcast_by_einsum(u, value)
        elif u.target is operator.getitem or carries_copied_whole(u, root):
            ok = _held_whole(u, depth - 1, root, held)
        else:
            return False
        if not ok:
            return False
    held.add(value)
    return True


def carries_copied_whole(node, root) -> bool:
    """``node`` computes from ``root`` (a part held whole) and values without a gradient
    only: rotary embeddings before the heads dim (PaLM's ``rope(k)`` of shape (B, T,
    head_dim); rotate_half's chunks and cat, or its ``(j d) -> j d`` view and ``unbind``).
    Every rank computes it whole, and its gradient is the rank's share, as the part's is
    (placements.CopiedWhole)."""
    if node.op != "call_function" \
            or not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        return False
    operands = [a for a in node.all_input_nodes if isinstance(a, torch.fx.Node)]
    return bool(operands) and all(_derived_from(o, root) for o in operands)


def copied_whole_unsqueeze(node, prop):
    """The unsqueeze of a part held whole (:func:`_unsqueezed_over_heads`): its new size-1
    dim carries the copy, placed and marked as GPTBigCode's copied kv head; else None."""
    src = node.args[0]
    weights = prop.copied_whole.get(src.name)
    h = node.args[1] % (len(shape(src)) + 1)
    if weights is None or not _spread_over_heads(node, h):
        return None
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(weights, 1, True)
    return Shard(h)


def one_head_unsqueeze(node, prop):
    """A column output of one head (multi-query k_proj, ``(B, T, D)``) unsqueezed to
    ``(B, 1, T, D)`` and then spread over the query heads (:func:`_spread_over_heads`): the
    separate-projection form of GPTBigCode's split, without a view into (.., 1, head_dim).
    The projection is one kv head copied to every rank (``replicated_heads(1, D)``), the
    value placed on the new dim and marked as copied heads; else None (the plain rules)."""
    src = node.args[0]
    raw = prop.raw.get(src.name)
    ins = shape(src)
    h = node.args[1] % (len(ins) + 1)
    column = raw or prop.part_slices.get(src.name, (None,))[0]  # or a part of a fused one
    if column and dim_of(prop, src) == len(ins) - 1 and len(ins) >= 3 and h <= len(ins) - 2 \
            and not any(u.target in _CUTS for u in node.users):  # not GPTBigCode's q | k | v
        # a new heads dim of 1 before (tokens, features): the shard would land on head_dim
        # (planning/tp_candidates.one_head_whole then tries the projection kept whole; its
        # one head broadcast against the rank's query heads, analysis/sharding/rules._matmul)
        prop.one_head_dim |= prop.groups.get(src.name, frozenset())
    if not raw or raw & prop.no_replication or dim_of(prop, src) != len(ins) - 1 \
            or h == len(ins) or not isinstance(ins[-1], int) \
            or any(prop.features.get(w) != ins[-1] for w in raw) \
            or not _spread_over_heads(node, h):
        return None
    prop.claimed.add(node.name)
    prop.heads[node.name] = HeadsMark(frozenset(raw), 1, True)
    record_use(prop, raw, ReplicatedHeads(1, ins[-1]), node)
    return Shard(h)


_COPIES = (aten.contiguous.default, aten.clone.default, aten.alias.default)
_CUTS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
         aten.slice.Tensor, aten.narrow.default)


def _spread_over_heads(value, h: int, depth: int = 12, root=None) -> bool:
    """Every use of ``value`` (dim ``h`` of size 1) spreads that dim over the query heads:
    an expand of ``h`` or of a new size-1 dim after it (repeat_kv's unsqueeze + expand),
    SDPA's key or value with ``enable_gqa`` (``h`` its heads dim), or a matmul broadcasting
    it against the query heads (:func:`_broadcast_by_matmul`), through full slices,
    unsqueezes, transposes, copies and rotary embeddings (element-wise ops with tables that
    keep ``h`` of size 1, :func:`_keeps_one`; a chunk or split along another dim). ``root``:
    where the walk began (the one head; default ``value``)."""
    root = value if root is None else root
    if depth == 0 or not value.users:
        return False
    for u in value.users:
        if u.op != "call_function" or u.args[0] is not value and u.target not in (
                aten.scaled_dot_product_attention.default, aten.matmul.default, *ROTARY):
            return False
        t, ins = u.target, shape(value)
        if t in _COPIES or t is aten.slice.Tensor and full_slice(u):
            ok = _spread_over_heads(u, h, depth - 1, root)
        elif t is aten.unsqueeze.default:
            k = u.args[1] % (len(ins) + 1)
            ok = _spread_over_heads(u, h + (1 if k <= h else 0), depth - 1, root)
        elif t is aten.transpose.int:
            a, b = (x % len(ins) for x in u.args[1:3])
            ok = _spread_over_heads(u, b if h == a else a if h == b else h, depth - 1, root)
        elif t is aten.expand.default:
            outs = shape(u)
            ok = len(outs) == len(ins) and any(
                j < len(ins) and same(ins[j], 1) and isinstance(outs[j], int) and outs[j] > 1
                for j in (h, h + 1))
        elif t is aten.scaled_dot_product_attention.default:
            ok = value in u.args[1:3] and value is not u.args[0] and h == 1 and \
                len(ins) == 4 and bool(u.kwargs.get("enable_gqa"))
        elif t is aten.matmul.default:
            ok = _broadcast_by_matmul(u, value, h)
        elif t in ROTARY and _keeps_one(u, value, h, root):
            ok = _spread_over_heads(u, h + len(shape(u)) - len(ins), depth - 1, root)
        elif t in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default) \
                and u.args[0] is value and (u.args[2] if len(u.args) > 2 else 0) % len(ins) != h:
            ok = all(g.target is operator.getitem and _spread_over_heads(g, h, depth - 1, root)
                     for g in u.users)
        else:
            return False
        if not ok:
            return False
    return True


# a search past this many nodes takes a value for one that carries a gradient
SEARCH_LIMIT = 256
ROTARY = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
           aten.cat.default)


def _keeps_one(node, value, h: int, root) -> bool:
    """``node`` (an element-wise op or a ``cat``, :data:`ROTARY`) keeps ``value``'s dim
    ``h`` of size 1, right-aligned, and its other operands carry no gradient except through
    ``root``, the head the walk began at (rotary's cos/sin tables, rotate_half's pieces): its
    output is still one head, a function of that head alone."""
    outs, ins = shape(node), shape(value)
    e = h + len(outs) - len(ins)
    if e < 0 or not same(outs[e], 1):
        return False
    if node.target is aten.cat.default:
        d = (node.args[1] if len(node.args) > 1 else 0) % len(outs)
        operands = list(node.args[0])
        if d == e:
            return False
    else:
        operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
    return all(o is value or _derived_from(o, root) for o in operands)


def _derived_from(node, value, depth: int = 24, memo=None) -> bool:
    """``node`` is computed from ``value`` and values without a gradient alone (rotate_half's
    ``cat(-x2, x1)`` of ``x``'s chunks, or its ``(d r)`` view, unbind, stack and view back;
    rotary tables of the positions), looked up at most ``depth`` ops back."""
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = node is value or not reads_parameters(node, SEARCH_LIMIT) or (
            depth > 0 and node.op == "call_function"
            and all(_derived_from(a, value, depth - 1, memo) for a in node.all_input_nodes))
    return memo[node]


def _broadcast_by_matmul(node, value, h: int) -> bool:
    """``value``'s size-1 dim ``h`` is a batch dim of the matmul ``node`` that the other
    operand holds larger (right-aligned): multi-query attention's one k or v head written
    as ``q @ k.transpose(-1, -2)`` / ``p @ v`` against the query heads, broadcast by the
    matmul itself (DTensor's matmul strategy for a broadcast batch dim)."""
    a, b = node.args[:2]
    if (a is value) == (b is value):
        return False
    other = b if a is value else a
    ins, oth = shape(value), shape(other)
    k = h - len(ins) + len(oth)
    return len(ins) >= 3 and len(oth) >= 3 and h < len(ins) - 2 and 0 <= k < len(oth) - 2 \
        and isinstance(oth[k], int) and oth[k] > 1
