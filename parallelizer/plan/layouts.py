"""Tensor-parallel layouts: which elements of a full tensor one tp rank holds, and where.

A tensor placed ``Shard(d)`` is cut along ``d`` only; what varies is how. A layout
(``TensorPlan.layout``) is ``None`` or one of the frozen classes below, each with its own
arithmetic (``local_length``, ``segments``, ``copied_runs``, ``copied_heads``), its
adaptation to another tp degree (``adapt``, used by ``reshard``) and its JSON form
(``to_json`` / :func:`layout_from_json`; ``plan.json`` and ``manifest.json`` store that):

- ``None``: Megatron-LM's even split (Shoeybi et al. 2019, §3): rank ``r`` holds the
  contiguous block ``[r * n / tp, (r + 1) * n / tp)`` of ``n = shape[d]``. Stored as
  ``null``; :class:`EvenSplit` holds its arithmetic (the module functions take ``None``).
- :class:`Fused` ``{"kind": "fused", "parts": [n0, n1, ...]}``: the dim is a concatenation
  of parts that are each split evenly, e.g. GPT-2's ``c_attn`` (q|k|v, ``[h, h, h]``) or a
  fused gate_up (``[i, i]``). Rank ``r`` holds ``concat(part_i block r)``, so a local
  ``split``/``chunk`` of the fused output still yields its own q, k and v. An optional
  ``"part_layouts"`` (one per part, ``None`` = the even split) lays a part out as
  ``replicated_heads``: Falcon's multi-query ``query_key_value`` (q heads | one k head | one
  v head, ``[h, D, D]``) is ``part_layouts [None, rh(1, D), rh(1, D)]``, so every rank holds
  its block of q heads and a copy of the k and v head.
- :class:`InterleavedHeads` ``{"kind": "interleaved_heads", "heads": H}``: GPT-NeoX's
  per-head ``[q_h k_h v_h]`` interleaving. Heads are contiguous, so the even split is
  already head-aligned; recorded so converters know the dim is not q|k|v. The compiler also
  records GQA kv projections split evenly this way, with ``"head_dim": D``, so a converter
  can turn them into ``replicated_heads`` for a tp above their head count.
- :class:`ReplicatedHeads` ``{"kind": "replicated_heads", "heads": K, "head_dim": D}``:
  tp > K kv heads (GQA, Ainslie et al. 2023): ``tp / K`` consecutive ranks hold a copy of
  the same head, rank ``r`` holds head ``r // (tp / K)``. Copies must be identical; a merge
  reads one.
- :class:`Padded` ``{"kind": "padded", "padded_size": P}``: the dim of ``n`` rows is padded
  to ``P`` (a multiple of tp) so tp divides it (vocab_parallel); rank ``r`` holds rows
  ``[r * P / tp, (r + 1) * P / tp)`` of the padded tensor, padding rows are zero and never
  exported. An optional ``"multiple": M`` (never written by the compiler; accepted from a
  manifest) makes ``adapt`` pad to a multiple of ``M x tp`` instead of ``tp`` (Megatron-LM's
  ``--make-vocab-size-divisible-by``).

All arithmetic raises ``ValueError`` on a layout that does not fit the tensor or the degree,
and :func:`layout_from_json` on JSON that is not a layout; the planners check the first
before and raise PlanError naming the spec key, the manifest schema turns the second into a
CheckpointError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional


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


@dataclass(frozen=True)
class EvenSplit:
    """Megatron's even split; the base of the other layouts, whose methods default to it.
    Never stored (``None`` stands for it); ``n``: elements of the full dim, ``tp``: degree."""

    kind: ClassVar[str] = "even"

    def local_length(self, n: int, tp: int) -> int:
        """Length along the tp dim of one rank's piece of a dim of ``n`` elements."""
        return _even(n, tp, "the sharded dim")

    def segments(self, n: int, tp: int, tp_rank: int) -> list[Segment]:
        """The runs of the full dim that tp rank ``tp_rank`` holds, in piece order; elements
        of the piece no segment covers are padding (zero). ``n = 12``, ``tp = 2``, rank 1:
        even ``[(6, 0, 6)]``; fused ``[4, 4, 4]`` ``[(2, 0, 2), (6, 2, 2), (10, 4, 2)]``."""
        if not 0 <= tp_rank < tp:
            raise ValueError(f"tp_rank {tp_rank} not in [0, {tp})")
        return self._segments(n, tp, tp_rank, self.local_length(n, tp))

    def _segments(self, n: int, tp: int, tp_rank: int, length: int) -> list[Segment]:
        return [Segment(tp_rank * length, 0, length)]

    def copied_runs(self, n: int, tp: int) -> list[tuple[int, int, int]]:
        """``(piece_offset, length, heads)`` for each run of a rank's piece that holds a
        copied head: ranks ``r`` with the same ``r // (tp / heads)`` hold the same bytes
        there, and their gradients must be summed. Same offsets on every rank."""
        return []

    def copied_heads(self) -> set[int]:
        """Head counts of the copied (``replicated_heads``) runs (empty: no copies)."""
        return set()

    def adapt(self, n: int, tp: int) -> "EvenSplit":
        """This layout for tp degree ``tp`` (``reshard``): the kind kept, its degree-dependent
        parts recomputed. Not checked: :meth:`check` that it fits."""
        return self

    def check(self, n: int, tp: int) -> None:
        """ValueError when this layout cannot hold a dim of ``n`` at degree ``tp``."""
        self.local_length(n, tp)

    def text(self) -> str:
        """The layout in report.md's words."""
        return self.kind

    def to_json(self) -> Optional[dict]:
        return None


@dataclass(frozen=True)
class InterleavedHeads(EvenSplit):
    """GPT-NeoX's per-head ``[q k v]`` (or GQA kv heads, ``head_dim`` set): the even split,
    which keeps heads whole when tp divides them."""

    heads: int
    head_dim: Optional[int] = None
    kind: ClassVar[str] = "interleaved_heads"

    def adapt(self, n: int, tp: int) -> EvenSplit:
        if self.head_dim is not None and tp > self.heads:
            return ReplicatedHeads(self.heads, self.head_dim)
        return self

    def check(self, n: int, tp: int) -> None:
        self.local_length(n, tp)
        if self.heads % tp:
            raise ValueError(f"tp degree {tp} does not divide the {self.heads} heads")

    def to_json(self) -> dict:
        out = {"kind": self.kind, "heads": self.heads}
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        return out


@dataclass(frozen=True)
class ReplicatedHeads(EvenSplit):
    """``heads`` kv heads of ``head_dim`` over more tp ranks: rank ``r`` holds a copy of head
    ``r // (tp / heads)``."""

    heads: int
    head_dim: int
    kind: ClassVar[str] = "replicated_heads"

    def local_length(self, n: int, tp: int) -> int:
        if self.heads * self.head_dim != n or tp % self.heads:
            raise ValueError(f"replicated_heads needs heads ({self.heads}) x head_dim "
                             f"({self.head_dim}) == {n} and heads dividing tp ({tp})")
        return self.head_dim

    def _segments(self, n, tp, tp_rank, length):
        head = tp_rank // (tp // self.heads)
        return [Segment(head * length, 0, length)]

    def copied_runs(self, n: int, tp: int) -> list[tuple[int, int, int]]:
        return [(0, self.local_length(n, tp), self.heads)]

    def copied_heads(self) -> set[int]:
        return {self.heads}

    def adapt(self, n: int, tp: int) -> EvenSplit:
        if tp <= self.heads:  # heads stay whole under the even split; head_dim kept to copy again
            return InterleavedHeads(self.heads, self.head_dim)
        return self

    def text(self) -> str:
        return (f"replicated_heads ({self.heads} kv heads of head_dim {self.head_dim}, fewer "
                f"than tp: rank r holds a copy of kv head r // (tp / {self.heads}), so each is "
                f"held by tp / {self.heads} ranks and its copies' gradients are summed)")

    def to_json(self) -> dict:
        return {"kind": self.kind, "heads": self.heads, "head_dim": self.head_dim}


@dataclass(frozen=True)
class Padded(EvenSplit):
    """``padded_size`` rows (zero beyond the ``n`` real ones) split evenly; ``multiple``:
    the padding unit over tp (None: 1, not stored)."""

    padded_size: int
    multiple: Optional[int] = None
    kind: ClassVar[str] = "padded"

    def local_length(self, n: int, tp: int) -> int:
        if self.padded_size < n:
            raise ValueError(f"padded_size {self.padded_size} < dim size {n}")
        return _even(self.padded_size, tp, "padded_size")

    def _segments(self, n, tp, tp_rank, length):
        lo = tp_rank * length
        # a rank past the real rows holds padding only (61 rows at tp 29: 3 each, rank 21 on)
        return [Segment(lo, 0, min(length, n - lo))] if lo < n else []

    def adapt(self, n: int, tp: int) -> "Padded":
        unit = (self.multiple or 1) * tp
        return Padded(-(-n // unit) * unit, self.multiple)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "padded_size": self.padded_size}
        if self.multiple is not None:
            out["multiple"] = self.multiple
        return out


_HEADS = (InterleavedHeads, ReplicatedHeads)


@dataclass(frozen=True)
class Fused(EvenSplit):
    """A concatenation of ``parts`` (sizes along the dim), each laid out on its own:
    ``part_layouts`` (None or empty: all even; else one per part, None or a heads layout)."""

    parts: tuple[int, ...]
    part_layouts: Optional[tuple[Optional[EvenSplit], ...]] = None
    kind: ClassVar[str] = "fused"

    def pairs(self) -> list[tuple[int, Optional[EvenSplit]]]:
        """(part size, part layout) of every part."""
        pls = self.part_layouts or (None,) * len(self.parts)
        if len(pls) != len(self.parts) or any(
                pl is not None and not isinstance(pl, _HEADS) for pl in pls):
            raise ValueError(f"part_layouts {list(pls)} must give each "
                             f"of the parts {list(self.parts)} None, replicated_heads or "
                             f"interleaved_heads")
        return list(zip(self.parts, pls))

    def local_length(self, n: int, tp: int) -> int:
        if sum(self.parts) != n:
            raise ValueError(f"fused parts {list(self.parts)} do not sum to the dim size {n}")
        return sum(part_length(p, pl, tp) for p, pl in self.pairs())

    def _segments(self, n, tp, tp_rank, length):
        out, start, at = [], 0, 0
        for part, pl in self.pairs():
            out += [Segment(start + s.full_offset, at + s.piece_offset, s.length)
                    for s in segments(part, pl, tp, tp_rank)]
            start, at = start + part, at + local_length(part, pl, tp)
        return out

    def copied_runs(self, n: int, tp: int) -> list[tuple[int, int, int]]:
        out, at = [], 0
        for part, pl in self.pairs():
            out += [(at + o, length, heads) for o, length, heads in copied_runs(part, pl, tp)]
            at += part_length(part, pl, tp)
        return out

    def copied_heads(self) -> set[int]:
        return {h for pl in self.part_layouts or () for h in copied_heads(pl)}

    def adapt(self, n: int, tp: int) -> "Fused":
        if not self.part_layouts:
            return self
        return Fused(self.parts, tuple(adapt(p, pl, tp)
                                       for p, pl in zip(self.parts, self.part_layouts)))

    def check(self, n: int, tp: int) -> None:
        self.local_length(n, tp)
        for p, pl in zip(self.parts, self.part_layouts or ()):
            check(p, pl, tp)

    def text(self) -> str:
        copied = [f"part {i} {pl.text()}" for i, pl in enumerate(self.part_layouts or ()) if pl]
        parts = list(self.parts)
        if len(parts) > 4 and len(set(parts)) == 1:  # heads inner: one part per head_dim
            parts = f"[{parts[0]}] x {len(parts)}"
        return f"fused {parts}" + (f" ({'; '.join(copied)})" if copied else "")

    def to_json(self) -> dict:
        out = {"kind": self.kind, "parts": list(self.parts)}
        if self.part_layouts is not None:
            out["part_layouts"] = [layout_json(pl) for pl in self.part_layouts]
        return out


_EVEN = EvenSplit()
KINDS = ("fused", "interleaved_heads", "replicated_heads", "padded")


# ---- the module functions: a layout or None (the even split) --------------------------------

def local_length(n: int, layout: Optional[EvenSplit], tp: int) -> int:
    """Length along the tp dim of one rank's piece of a dim of ``n`` elements."""
    return (layout or _EVEN).local_length(n, tp)


def segments(n: int, layout: Optional[EvenSplit], tp: int, tp_rank: int) -> list[Segment]:
    """:meth:`EvenSplit.segments` of ``layout`` (None: the even split)."""
    return (layout or _EVEN).segments(n, tp, tp_rank)


def part_length(part: int, pl: Optional[EvenSplit], tp: int) -> int:
    """Local length of one fused part (``pl`` None: split evenly)."""
    return _even(part, tp, "a fused part") if pl is None else pl.local_length(part, tp)


def local_offset(at: int, layout: Optional[EvenSplit], tp: int) -> int:
    """Where full offset ``at`` (0, the dim's end or a fused part boundary) lands in a rank's
    piece: ``at // tp`` unless ``layout`` is :class:`Fused`, else the local lengths of the
    parts before it."""
    if not isinstance(layout, Fused):
        return at // tp
    full = local = 0
    for part, pl in layout.pairs():
        if full >= at:
            break
        full, local = full + part, local + part_length(part, pl, tp)
    return local


def side_by_side(n: int, ranges: list) -> Optional[EvenSplit]:
    """The layout of a dim of ``n`` elements whose ranges ``(lo, hi, layout)`` are each laid
    out on their own (a parameter cut into pieces, each read by its own linear): one range
    covering the dim keeps its layout, else a :class:`Fused` of the ranges' parts (a fused
    range contributes its parts); elements no range covers are an even part of their own.

    Raises:
        ValueError: ranges overlap, or a range is :class:`Padded` (no fused part can be).
    """
    if len(ranges) == 1 and tuple(ranges[0][:2]) == (0, n):
        return ranges[0][2]
    pairs, at = [], 0
    for lo, hi, layout in sorted(ranges, key=lambda r: r[:2]):
        if lo < at:
            raise ValueError(f"the range [{lo}, {hi}) overlaps the one before it")
        if lo > at:
            pairs.append((lo - at, None))
        if isinstance(layout, Fused):
            pairs += layout.pairs()
        elif layout is None or isinstance(layout, _HEADS):
            pairs.append((hi - lo, layout))
        else:
            raise ValueError(f"a {layout.kind} range [{lo}, {hi}) cannot be a fused part")
        at = hi
    if at < n:
        pairs.append((n - at, None))
    if len(pairs) == 1:
        return pairs[0][1]
    pls = tuple(pl for _p, pl in pairs)
    return Fused(tuple(p for p, _pl in pairs), pls if any(pls) else None)


def copied_runs(n: int, layout: Optional[EvenSplit], tp: int) -> list[tuple[int, int, int]]:
    """:meth:`EvenSplit.copied_runs` of ``layout``; empty when nothing is copied."""
    return (layout or _EVEN).copied_runs(n, tp)


def copied_heads(layout: Optional[EvenSplit]) -> set[int]:
    """Head counts of the ``replicated_heads`` parts of ``layout`` (empty: no copies)."""
    return (layout or _EVEN).copied_heads()


def adapt(n: int, layout: Optional[EvenSplit], tp: int) -> Optional[EvenSplit]:
    """:meth:`EvenSplit.adapt` of ``layout`` (None stays None), unchecked."""
    return None if layout is None else layout.adapt(n, tp)


def in_units(layout: Optional[EvenSplit], r: int) -> Optional[EvenSplit]:
    """``layout`` of a dim whose every element stands for ``r`` consecutive elements of the
    dim it laid out: a parameter dim merged with the ones after it into a weight matrix's
    rows (an einsum's per-head ``(H, D_h, D)`` read as ``(H * D_h, D)``, ``r = D_h``), so the
    checkpoint cuts the parameter's own dim. ValueError when a run of it does not start and
    end on a multiple of ``r`` (no parameter slice holds it)."""
    def div(v: int) -> int:
        if v % r:
            raise ValueError(f"{v} elements are not whole rows of {r}")
        return v // r
    if layout is None or r == 1:
        return layout
    if isinstance(layout, InterleavedHeads):
        return InterleavedHeads(layout.heads, None if layout.head_dim is None
                                else div(layout.head_dim))
    if isinstance(layout, ReplicatedHeads):
        return ReplicatedHeads(layout.heads, div(layout.head_dim))
    if isinstance(layout, Fused):
        return Fused(tuple(div(p) for p in layout.parts), None if layout.part_layouts is None
                     else tuple(in_units(pl, r) for pl in layout.part_layouts))
    raise ValueError(f"a {layout.kind} layout is not one of whole rows of {r}")


def check(n: int, layout: Optional[EvenSplit], tp: int) -> None:
    """:meth:`EvenSplit.check`: ValueError when ``layout`` cannot hold ``n`` at ``tp``."""
    (layout or _EVEN).check(n, tp)


def layout_json(layout: Optional[EvenSplit]) -> Optional[dict]:
    """The JSON form stored in plan.json and manifest.json (None for the even split)."""
    return None if layout is None else layout.to_json()


# ---- from JSON: the one validation of a stored layout -------------------------------------

def layout_from_json(d: Any, where: str = "layout") -> Optional[EvenSplit]:
    """The layout of JSON ``d`` (None stays None); keys beyond a kind's own are ignored.

    Raises:
        ValueError: not an object, an unknown ``kind``, or a field missing or not a
            positive int (``parts``: a non-empty list of them; ``part_layouts``: one None or
            heads layout per part); names ``where`` and the key.
    """
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object with a 'kind' or null, got {d!r}")
    kind = d.get("kind")
    parse = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise ValueError(f"unknown layout kind {kind!r}; known: {', '.join(KINDS)}")
    return parse(d, where)


def _pos(d: dict, key: str, where: str, required: bool = True) -> Optional[int]:
    """``d[key]``, a positive int (an optional key may be absent or null)."""
    if d.get(key) is None and not required:
        return None
    return _positive(d.get(key), f"{where}: {d.get('kind')} needs '{key}'")


def _positive(v: Any, what: str) -> int:
    if type(v) is not int or v < 1:  # not bool, not float: the schema's strict ints
        raise ValueError(f"{what} a positive int, got {v!r}")
    return v


def _heads(d, where):
    return InterleavedHeads(_pos(d, "heads", where), _pos(d, "head_dim", where, False))


def _fused(d, where):
    parts = d.get("parts")
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"{where}: fused needs 'parts' a non-empty list, got {parts!r}")
    sizes = tuple(_positive(p, f"{where}: each of the fused parts must be") for p in parts)
    pls = d.get("part_layouts")
    if pls is None:
        return Fused(sizes)
    if not isinstance(pls, (list, tuple)) or len(pls) not in (0, len(sizes)) or any(
            pl is not None and (not isinstance(pl, dict) or pl.get("kind") not in
                                ("replicated_heads", "interleaved_heads")) for pl in pls):
        raise ValueError(f"part_layouts {pls} must give each of the parts {list(sizes)} None, "
                         f"replicated_heads or interleaved_heads")
    return Fused(sizes, tuple(layout_from_json(pl, f"{where}.part_layouts") for pl in pls))


_PARSERS = {
    "fused": _fused,
    "interleaved_heads": _heads,
    "replicated_heads": lambda d, w: ReplicatedHeads(_pos(d, "heads", w), _pos(d, "head_dim", w)),
    "padded": lambda d, w: Padded(_pos(d, "padded_size", w), _pos(d, "multiple", w, False)),
}
