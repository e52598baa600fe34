"""The ``experts`` layout: a stacked expert weight (E, ...) split along dim 0 over ep ranks.

Expert parallelism (docs/expert-parallel.md) gives ep rank ``e`` the contiguous experts
``[e E/ep, (e + 1) E/ep)`` of every stacked weight of a mixture-of-experts layer, as
torchtitan's ``ExpertParallel`` (``Shard(0)`` over the ep mesh dim) and Megatron-LM's
expert-parallel groups do. ``TensorPlan.experts`` holds it (None: not an expert weight);
plan.json and manifest.json store its JSON form ``{"kind": "experts", "ep": N, "dim": 0}``.
The tp layouts (:mod:`parallelizer.plan.layouts`) tile ``tp_dim``; this one tiles dim 0 over
a different mesh dim, so the two compose (an expert weight can be both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Experts:
    """``ep``: ranks the experts are split over; ``dim``: the experts dim (0)."""

    ep: int
    dim: int = 0
    kind = "experts"

    def local_length(self, n: int) -> int:
        """Experts per ep rank of a dim of ``n`` experts.

        Raises:
            ValueError: ep does not divide n.
        """
        if n % self.ep:
            raise ValueError(f"ep degree {self.ep} does not divide the {n} experts")
        return n // self.ep

    def rows(self, n: int, ep_rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the experts dim ep rank ``ep_rank`` holds."""
        if not 0 <= ep_rank < self.ep:
            raise ValueError(f"ep_rank {ep_rank} not in [0, {self.ep})")
        k = self.local_length(n)
        return ep_rank * k, (ep_rank + 1) * k

    def local_shape(self, shape: tuple) -> tuple:
        s = list(shape)
        s[self.dim] = self.local_length(s[self.dim])
        return tuple(s)

    def to_json(self) -> dict:
        return {"kind": self.kind, "ep": self.ep, "dim": self.dim}

    def text(self) -> str:
        return f"experts (dim {self.dim} over ep={self.ep})"


def experts_json(layout: Optional[Experts]) -> Optional[dict]:
    return None if layout is None else layout.to_json()


def experts_from_json(d: Any, where: str = "experts") -> Optional[Experts]:
    """The layout of JSON ``d`` (None stays None).

    Raises:
        ValueError: not ``{"kind": "experts", "ep": int >= 1, "dim": 0}``.
    """
    if d is None:
        return None
    if not isinstance(d, dict) or d.get("kind") != "experts":
        raise ValueError(f"{where} must be null or an object with kind 'experts', got {d!r}")
    ep, dim = d.get("ep"), d.get("dim", 0)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dim != 0:
        raise ValueError(f"{where}: 'ep' must be an integer >= 1 and 'dim' 0, got {d!r}")
    return Experts(ep, dim)
