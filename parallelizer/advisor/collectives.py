"""Seconds of one collective on the cluster: the measured α/β of that op and group size when
the cluster was calibrated (``measured.collectives``), else the ring model on the links of
the cluster file (Thakur, Rabenseifner & Gropp 2005, §3; Patarasuk & Yuan 2009): over g
ranks, n bytes (the full tensor), latency α and per-GPU bandwidth β,

    all-reduce      2 (g-1) α + 2 (g-1)/g · n/β
    reduce-scatter  (g-1) α + (g-1)/g · n/β          all-gather, all-to-all: the same
    send / recv     α + n/β

A group of ``g`` ranks ``stride`` apart (ranks numbered node by node) stays inside a node
when g x stride <= gpus_per_node (NVLink, ``intra_node``), else crosses the network
(``inter_node``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .measured import moved_fraction


def ring_allreduce(n: float, g: int, link) -> float:
    if g <= 1 or n <= 0:
        return 0.0
    return 2 * (g - 1) * link.latency_us * 1e-6 + 2 * (g - 1) / g * n / (link.bandwidth_gb_s * 1e9)


def ring_gather(n: float, g: int, link) -> float:
    """Reduce-scatter or all-gather of ``n`` bytes (the full tensor) over ``g`` ranks."""
    if g <= 1 or n <= 0:
        return 0.0
    return (g - 1) * link.latency_us * 1e-6 + (g - 1) / g * n / (link.bandwidth_gb_s * 1e9)


def send(n: float, link) -> float:
    return link.latency_us * 1e-6 + n / (link.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class Call:
    """One kind of collective in a step: op, the mesh dim it runs over, group size, calls per
    step, bytes per call (the full tensor) and seconds per call."""
    op: str
    dim: str
    group: int
    calls: float
    nbytes: float
    seconds: float

    @property
    def total(self) -> float:
        return self.calls * self.seconds

    @property
    def sent(self) -> float:
        """Bytes one rank sends per step (ring algorithms)."""
        return self.calls * moved_fraction(self.op, self.group) * self.nbytes


class Comm:
    """Collective times on ``cluster`` (module docstring)."""

    def __init__(self, cluster):
        from .measured import Lookups
        self.cluster = cluster
        self.lookups = Lookups(cluster.measured) if cluster.measured is not None else None
        self._cache: dict = {}

    def scope(self, g: int, stride: int) -> str:
        crosses = g > 1 and g * stride > self.cluster.gpus_per_node
        return "inter_node" if crosses else "intra_node"

    def seconds(self, op: str, nbytes: float, g: int, stride: int = 1) -> float:
        if g <= 1 or nbytes < 0:
            return 0.0
        key = (op, nbytes, g, stride)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 100000:
                self._cache.clear()
            hit = self._cache[key] = self._seconds(op, nbytes, g, stride)
        return hit

    def _seconds(self, op: str, nbytes: float, g: int, stride: int) -> float:
        scope = self.scope(g, stride)
        if self.lookups is not None:
            fit = self.lookups.collective(op, g, scope)
            if fit is not None:
                return fit.seconds(moved_fraction(op, g) * nbytes)
        link = self.cluster.link(g, stride)
        if op == "all_reduce":
            return ring_allreduce(nbytes, g, link)
        if op == "send_recv":
            return send(nbytes, link)
        return ring_gather(nbytes, g, link)

    def call(self, op: str, dim: str, nbytes: float, g: int, stride: int = 1, calls: float = 1) -> Call:
        return Call(op, dim, g, calls, nbytes, self.seconds(op, nbytes, g, stride))

    def source(self, op: str, g: int, stride: int = 1) -> str:
        if self.lookups is not None and self.lookups.collective(op, g, self.scope(g, stride)):
            return "measured"
        return "cluster links"
