"""Sharding rules for ops that re-lay dims other than the sharded one, and for GQA's
``repeat_interleave`` (issue 23, part 4: the Llama 3 reference model and torchtitan).

- ``view_as_complex`` / ``view_as_real`` (a rotary embedding on complex q and k,
  ``freqs_cis``): the (re, im) pair is the last dim; any other sharded dim keeps its index.
- ``flatten.using_ints``: dims ``[start, end]`` merge; a sharded dim outside them moves by the
  dims merged away, one that starts the run is the merged dim's (as DTensor does). Copied kv
  heads expanded by repeat_kv's new inner dim merge as repeat_kv's reshape merges them
  (torchtune's ``k.unsqueeze(2).expand(...).flatten(1, 2)``).
- ``repeat_interleave(x, n_rep, dim)`` over the sharded heads dim of kv heads: query head
  ``h`` reads kv head ``h // n_rep``, the order of transformers' repeat_kv (expand + reshape),
  so a rank's even block of kv heads repeated gives its block of query heads. When tp
  exceeds the kv heads and each rank holds a copy of one (``replicated_heads``), the rank
  serves ``heads / tp`` query heads of it: its local ``n_rep`` is ``n_rep * kv / tp``.

All keep the raw / kv-heads markers (:mod:`.propagate`) where the sharded dim is untouched,
so a copied kv head may flow through a complex rotary embedding into ``repeat_interleave``.
"""
from __future__ import annotations

from ..graph_facts import aten, module_path, shape
from .placements import CONFLICT, Shard
from .layouts import merge_repeated_heads
from .state import add_constraint, add_rewrite, dim_arg, dim_of, mark_not_replicable


def complex_view_rule(node, prop, tp):
    """view_as_complex drops the last dim (the pair), view_as_real adds it: a sharded dim
    before it keeps its index."""
    d = dim_of(prop, node.args[0])
    pair = len(shape(node.args[0])) - 1
    return CONFLICT if node.target is aten.view_as_complex.default and d >= pair else Shard(d)


def flatten_rule(node, prop, tp):
    """flatten(x, start, end): merges dims ``start..end``."""
    src = node.args[0]
    d, rank = dim_of(prop, src), len(shape(src))
    start = dim_arg(node, 1) if len(node.args) > 1 else 0
    end = node.args[2] % rank if len(node.args) > 2 else rank - 1
    if d < start:
        return Shard(d)
    if d > end:
        return Shard(d - (end - start))
    mark = prop.heads.get(src.name)
    if mark is not None and mark.replicated and mark.expanded and (start, end) == (d, d + 1):
        return merge_repeated_heads(node, prop, tp, d, mark)  # torchtune's repeat of kv heads
    if mark is not None:  # heads merged with other dims: no longer heads of their own
        prop.claimed.add(node.name)
        if mark.replicated:
            mark_not_replicable(prop, [mark], node)
            return CONFLICT
    return Shard(start) if d == start else CONFLICT


def _local_output_size(node, prop, tp: int) -> None:
    """The ``output_size`` a repeat along the sharded dim spells (diffusers' GQA:
    ``repeat_interleave(k, r, dim=1, output_size=k.shape[1] * r)``) is the rank's: each rank's
    output holds 1 / tp of the repeated dim, whether its input is a block or a copy."""
    size = node.args[3] if len(node.args) > 3 else node.kwargs.get("output_size")
    if isinstance(size, int):
        add_rewrite(prop, node, 3 if len(node.args) > 3 else "output_size", None, size // tp)


def repeat_interleave_rule(node, prop, tp):
    """repeat_interleave(x, n_rep (int), dim) (see the module docstring)."""
    src = node.args[0]
    d = dim_of(prop, src)
    n_rep = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(n_rep, int) or dim is None:
        return CONFLICT  # a tensor of repeats, or the flattened input
    dim %= len(shape(src))
    if dim != d:
        return Shard(d)
    _local_output_size(node, prop, tp)
    mark = prop.heads.get(src.name)
    if mark is None or mark.expanded:
        return Shard(d)  # an even block repeated: the block of the repeated dim
    prop.claimed.add(node.name)
    prop.kv_weights |= mark.weights
    heads = n_rep * mark.heads
    add_constraint(prop, heads, "heads", module_path(node), f"dim {d} of repeat_interleave")
    if mark.replicated:
        if len(node.args) < 2:
            return CONFLICT  # repeats given by keyword: no constant to make local
        add_rewrite(prop, node, 1, None, heads // tp)
    return Shard(d)
