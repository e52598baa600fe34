"""Tensor-parallel ranks as threads of one process, for the compile's numerics self-check
(emit/numerics_check.py): the runtime's own tp operators (runtime/tp.py, vocab.py,
vocab_loss.py, sequence.py) with their transport swapped for an exchange between threads.

The operators read their transport from a module global (``tp.using_transport``,
``sequence.using_comm``), so one object serves every rank and asks a thread-local for the
rank of the calling thread. A CPU backward runs on the thread that called it (autograd's
engine executes CPU work on the calling thread), so the collectives of a rank's backward
find its rank too.

Each collective is a rendezvous of all ranks over one barrier: each rank puts its tensor in
its slot, all read every slot, then wait again before the slots are reused. Sums are taken
in rank order on every rank, so all ranks get the same bits, as an all-reduce gives. Every
exchange carries the collective's name: ranks that disagree on which collective comes next
(a program whose ranks run different collectives) fail with :class:`RankDivergence`
instead of waiting forever, and a rank that raises aborts the barrier so that the others
stop too.

Why threads and not torch's ``LocalTensorMode`` (torch.distributed._local_tensor): it
intercepts collectives issued to a process group, so the compiler would have to create a
(fake) default process group in the user's process, and the operators' per-rank Python
integers (a vocabulary offset ``tp_rank * n``, a sequence shard's start) would have to
become its per-rank ``LocalIntNode`` values; with threads every rank is plain PyTorch.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ..runtime import sequence
from ..runtime.tp import using_transport

TIMEOUT_S = 600.0  # a rank waiting this long for its peers: they are stuck, not slow


class RankDivergence(RuntimeError):
    """The ranks reached different collectives (or one finished while others communicate)."""


class Exchange:
    """The rendezvous of ``tp`` rank threads; :meth:`bind` names the calling thread's rank."""

    def __init__(self, tp: int):
        self.tp = tp
        self.slots: list = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=TIMEOUT_S)
        self._local = threading.local()

    def bind(self, rank: int) -> None:
        self._local.rank = rank

    def rank(self) -> int:
        return self._local.rank

    def exchange(self, what: str, t) -> list:
        """Every rank's ``t`` (detached), in rank order, once all ranks reached ``what``.

        Raises:
            RankDivergence: another rank reached a different collective.
            threading.BrokenBarrierError: another rank failed (its error is the one to report).
        """
        r = self.rank()
        self.slots[r] = (what, t.detach() if isinstance(t, torch.Tensor) else t)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        names = [g[0] for g in got]
        if len(set(names)) > 1:
            raise RankDivergence(f"the tp ranks reached different collectives: {names}")
        return [g[1] for g in got]

    def finish(self) -> None:
        """A rank done: its peers must be done too (not waiting in a collective)."""
        self.exchange("end of the step", None)

    def abort(self) -> None:
        self.barrier.abort()


class _OverExchange:
    """A transport of the calling thread's rank over an :class:`Exchange`."""

    def __init__(self, exchange: Exchange):
        self.ex = exchange

    def size(self) -> int:
        return self.ex.tp

    def rank(self) -> int:
        return self.ex.rank()


class RankTransport(_OverExchange):
    """runtime/tp.py's transport (``ShapeTransport``'s interface) over an :class:`Exchange`:
    f, g, scatter, the vocab-parallel lookup, gather and cross-entropy."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        parts = self.ex.exchange(f"all_reduce({op})", t)
        if op == "max":
            return torch.stack(parts).amax(0)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, t: torch.Tensor) -> list:
        return [p.clone() for p in self.ex.exchange("all_gather", t)]


class RankComm(_OverExchange):
    """runtime/sequence.py's transport (``ProcessGroupComm``'s interface) over an
    :class:`Exchange`: gathers concatenate along dim 0, reduce-scatters sum and keep this
    rank's 1/tp of dim 0."""

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.ex.exchange("sequence all_gather", t), 0)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.ex.exchange("sequence reduce_scatter", t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.chunk(self.ex.tp, 0)[self.rank()].clone()


@contextlib.contextmanager
def rank_threads(tp: int):
    """Within the block the tp operators communicate between rank threads; yields the
    :class:`Exchange` (each thread calls ``bind(rank)`` first; see :func:`run_ranks`)."""
    ex = Exchange(tp)
    with using_transport(RankTransport(ex)), sequence.using_comm(RankComm(ex)):
        yield ex


def run_ranks(ex: Exchange, work) -> list:
    """``work(rank)`` on one thread per rank (inside :func:`rank_threads`); their results in
    rank order. The first real error of a rank is raised, with its rank as ``e.tp_rank``
    (a peer's broken barrier is the consequence, not the cause)."""
    results, errors = [None] * ex.tp, []

    def main(rank: int):
        ex.bind(rank)
        try:
            results[rank] = work(rank)
            ex.finish()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append((isinstance(e, threading.BrokenBarrierError), rank, e))
            ex.abort()

    threads = [threading.Thread(target=main, args=(r,), name=f"tp rank {r}") for r in range(ex.tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        _, rank, e = sorted(errors, key=lambda x: (x[0], x[1]))[0]
        e.tp_rank = rank
        raise e
    return results
