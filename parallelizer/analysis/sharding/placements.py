"""The placement of a value over the tp mesh dim during sharding propagation.

DTensor's own placements (torch.distributed.tensor.placement_types, torch 2.13) where one
exists: ``Shard(d)`` (dim ``d`` of the *global* shape recorded by export, ``d >= 0``) and
``Replicate()``. ``Partial`` never flows here: a row_parallel linear's output is partial
only until its Megatron g, which propagation applies at once (the output is Replicate), and
a DTensor strategy answering Partial is a conflict. Two more that DTensor has no placement
for:

- :class:`PerOutput`: the placements of a multi-output op's values (split, unbind,
  var_mean), one per output; ``getitem`` reads one of them.
- :class:`Conflict` (:data:`CONFLICT`): no placement; the op cannot take its inputs'
  placements (the reason is in ``Propagation.conflicts``) and every value computed from it
  has none either.

one for a part of a column output held whole by every rank (:class:`CopiedWhole`), and
one only a redistribution asks for (:mod:`.redistribute`):

- :class:`CopiedHeads`: a replicated value read, on one edge, as the copy of one of its
  ``heads`` entries along ``dim`` that the rank's query heads read (GQA kv heads when tp is a
  multiple of them); inside the reader it is a ``Shard(dim)`` with a copied-heads mark.
- :class:`LaidOut`: a replicated value read, on one edge, as the rank's piece under the
  layout of a column linear's output (a fused q|k|v's parts, each cut to the rank's heads);
  inside the reader it is a ``Shard(dim)`` raw from that linear.

All compare by value and hash, so they serve as dict values, set members and ``==``
operands (``Shard(2) == Shard(2)``; ``Shard(2) != 2``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch.distributed.tensor.placement_types import Replicate, Shard

REPLICATE = Replicate()


@dataclass(frozen=True)
class PerOutput:
    """Placements of the outputs of a multi-output op, by output index."""

    outputs: tuple

    def __getitem__(self, i: int):
        return self.outputs[i]


@dataclass(frozen=True)
class Conflict:
    """No placement: a value whose op could not take its inputs' placements."""


CONFLICT = Conflict()


@dataclass(frozen=True)
class CopiedHeads:
    """Each tp rank keeps entry ``r // (tp / heads)`` of the ``heads`` entries along ``dim``
    (tp a multiple of ``heads``): the kv head its block of query heads reads."""

    dim: int
    heads: int


@dataclass(frozen=True)
class LaidOut:
    """Each tp rank keeps its piece of dim ``dim`` under the layout of the column linear
    ``key`` (:func:`parallelizer.plan.layouts.segments`; the even split's block when the
    linear has no other layout): what a bias of that linear would hold."""

    dim: int
    key: str


class CopiedWhole(Replicate):
    """A part of a column output that every rank holds whole, as the copy of one head with
    no heads dim to place it on (PaLM's multi-query k and v parts of its fused projection,
    read by ``einsum('bhid,bjd->bhij', q, k)``): forward rules read it as Replicate (it
    equals ``REPLICATE``), while its gradient is only the rank's query heads' contribution,
    as a shard's is (``analysis/gradient_forward.varies``), so no f makes it whole."""

    def __repr__(self) -> str:
        return "CopiedWhole()"


COPIED_WHOLE = CopiedWhole()

Placement = Union[Shard, Replicate, PerOutput, Conflict]


def shard(d: Optional[int]) -> Union[Shard, Replicate]:
    """``Shard(d)``, or Replicate for None (a dim computed from a replicated input)."""
    return REPLICATE if d is None else Shard(d)


def shard_dim(p) -> Optional[int]:
    """The dim of a ``Shard``; None for anything else."""
    return p.dim if isinstance(p, Shard) else None


def is_replicated(p) -> bool:
    """``p`` is Replicate (None: a value propagation gave no placement, e.g. a node a pass
    inserted later, is replicated too). PerOutput and Conflict are not."""
    return p is None or isinstance(p, Replicate)
