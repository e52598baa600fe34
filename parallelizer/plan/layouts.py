"""Tensor-parallel layouts: which elements of a full tensor one tp rank holds, and where.

A tensor placed ``Shard(d)`` is cut along ``d`` only; what varies is how. A layout is plain
JSON data (``TensorPlan.layout``), one of:

- ``None``: Megatron-LM's even split (Shoeybi et al. 2019, §3): rank ``r`` holds the
  contiguous block ``[r * n / tp, (r + 1) * n / tp)`` of ``n = shape[d]``.
- ``{"kind": "fused", "parts": [n0, n1, ...]}``: the dim is a concatenation of parts that are
  each split evenly, e.g. GPT-2's ``c_attn`` (q|k|v, ``[h, h, h]``) or a fused gate_up
  (``[i, i]``). Rank ``r`` holds ``concat(part_i block r)``, so a local ``split``/``chunk`` of
  the fused output still yields its own q, k and v. An optional ``"part_layouts"`` (one per
  part, ``None`` = the even split) lays a part out as ``replicated_heads``: Falcon's
  multi-query ``query_key_value`` (q heads | one k head | one v head, ``[h, D, D]``) is
  ``part_layouts [None, rh(1, D), rh(1, D)]``, so every rank holds its block of q heads and
  a copy of the k and v head.
- ``{"kind": "interleaved_heads", "heads": H}``: GPT-NeoX's per-head ``[q_h k_h v_h]``
  interleaving. Heads are contiguous, so the even split is already head-aligned; recorded so
  converters know the dim is not q|k|v. The compiler also records GQA kv projections split
  evenly this way, with ``"head_dim": D``, so a converter can turn them into
  ``replicated_heads`` for a tp above their head count.
- ``{"kind": "replicated_heads", "heads": K, "head_dim": D}``: tp > K kv heads (GQA,
  Ainslie et al. 2023): ``tp / K`` consecutive ranks hold a copy of the same head, rank ``r``
  holds head ``r // (tp / K)``. Copies must be identical; a merge reads one.
- ``{"kind": "padded", "padded_size": P}``: the dim of ``n`` rows is padded to ``P`` (a
  multiple of tp) so tp divides it (vocab_parallel); rank ``r`` holds rows
  ``[r * P / tp, (r + 1) * P / tp)`` of the padded tensor, padding rows are zero and never
  exported.

All functions raise ``ValueError`` on a layout that does not fit the tensor or the degree;
the planners check that first and raise PlanError naming the spec key.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

KINDS = ("fused", "interleaved_heads", "replicated_heads", "padded")


class Segment(NamedTuple):
    """A run of ``length`` elements along the tp dim: ``full[full_offset:...]`` is
    ``piece[piece_offset:...]``."""

    full_offset: int
    piece_offset: int
    length: int


def _even(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tp degree {tp} does not divide {what} ({n})")
    return n // tp


def local_length(n: int, layout: Optional[dict], tp: int) -> int:
    """Length along the tp dim of one rank's piece of a dim of ``n`` elements."""
    kind = (layout or {}).get("kind")
    if kind == "replicated_heads":
        heads, head_dim = layout["heads"], layout["head_dim"]
        if heads * head_dim != n or tp % heads:
            raise ValueError(f"replicated_heads needs heads ({heads}) x head_dim ({head_dim}) == "
                             f"{n} and heads dividing tp ({tp})")
        return head_dim
    if kind == "padded":
        if layout["padded_size"] < n:
            raise ValueError(f"padded_size {layout['padded_size']} < dim size {n}")
        return _even(layout["padded_size"], tp, "padded_size")
    if kind == "fused":
        if sum(layout["parts"]) != n:
            raise ValueError(f"fused parts {layout['parts']} do not sum to the dim size {n}")
        return sum(part_length(p, pl, tp) for p, pl in fused_parts(layout))
    if kind not in (None, "interleaved_heads"):
        raise ValueError(f"unknown layout kind {kind!r}; known: {', '.join(KINDS)}")
    return _even(n, tp, "the sharded dim")


def segments(n: int, layout: Optional[dict], tp: int, tp_rank: int) -> list[Segment]:
    """The runs of the full dim (``n`` elements) that tp rank ``tp_rank`` holds, in piece order.

    Elements of the piece not covered by a segment are padding (zero). Examples, ``n = 12``,
    ``tp = 2``, rank 1: ``None`` -> ``[(6, 0, 6)]``; fused ``[4, 4, 4]`` ->
    ``[(2, 0, 2), (6, 2, 2), (10, 4, 2)]``.
    """
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp})")
    length = local_length(n, layout, tp)
    kind = (layout or {}).get("kind")
    if kind == "fused":
        out, start, at = [], 0, 0
        for part, pl in fused_parts(layout):
            out += [Segment(start + s.full_offset, at + s.piece_offset, s.length)
                    for s in segments(part, pl, tp, tp_rank)]
            start, at = start + part, at + local_length(part, pl, tp)
        return out
    if kind == "replicated_heads":
        head = tp_rank // (tp // layout["heads"])
        return [Segment(head * length, 0, length)]
    if kind == "padded":
        lo = tp_rank * length
        return [Segment(lo, 0, max(0, min(length, n - lo)))]
    return [Segment(tp_rank * length, 0, length)]


def fused_parts(layout: dict) -> list:
    """(part size, part layout) pairs of a fused layout."""
    pls = layout.get("part_layouts") or [None] * len(layout["parts"])
    if len(pls) != len(layout["parts"]) or any(
            pl is not None and pl.get("kind") not in ("replicated_heads", "interleaved_heads")
            for pl in pls):
        raise ValueError(f"part_layouts {pls} must give each of the parts {layout['parts']} "
                         f"None, replicated_heads or interleaved_heads")
    return list(zip(layout["parts"], pls))


def part_length(part: int, pl: Optional[dict], tp: int) -> int:
    return _even(part, tp, "a fused part") if pl is None else local_length(part, pl, tp)


def copied_runs(n: int, layout: Optional[dict], tp: int) -> list[tuple[int, int, int]]:
    """``(piece_offset, length, heads)`` for each run of a rank's piece that holds a copied
    head (``replicated_heads``, alone or as a fused part): ranks ``r`` with the same
    ``r // (tp / heads)`` hold the same bytes there, and their gradients must be summed.
    Empty when nothing is copied. Same offsets on every rank."""
    kind = (layout or {}).get("kind")
    if kind == "replicated_heads":
        return [(0, local_length(n, layout, tp), layout["heads"])]
    if kind != "fused":
        return []
    out, at = [], 0
    for part, pl in fused_parts(layout):
        length = part_length(part, pl, tp)
        if (pl or {}).get("kind") == "replicated_heads":
            out.append((at, length, pl["heads"]))
        at += length
    return out


def copied_heads(layout: Optional[dict]) -> set[int]:
    """Head counts of the ``replicated_heads`` parts of ``layout`` (empty: no copies)."""
    kind = (layout or {}).get("kind")
    if kind == "replicated_heads":
        return {layout["heads"]}
    if kind == "fused":
        return {pl["heads"] for pl in layout.get("part_layouts") or []
                if (pl or {}).get("kind") == "replicated_heads"}
    return set()
