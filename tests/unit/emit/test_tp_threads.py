"""emit/tp_threads.py: tp ranks as threads, the runtime's operators over them.

- f and g (runtime/tp.py), the sequence-parallel reduce-scatter (runtime/sequence.py) and the
  vocab gather (runtime/vocab.py) give each rank what a process group would, and every rank
  the same bits for a sum; a backward on the rank's thread finds its rank.
- Ranks reaching different collectives fail with RankDivergence instead of waiting; a rank
  that raises stops its peers and its error is the one raised, naming its rank.
"""
from __future__ import annotations

import pytest
import torch

from parallelizer.emit.tp_threads import RankDivergence, rank_threads, run_ranks
from parallelizer.runtime import sequence
from parallelizer.runtime.tp import copy_to_tp_region, reduce_from_tp_region
from parallelizer.runtime.vocab import gather_from_tp_region


def test_collectives_and_backward_over_threads():
    pieces = [torch.randn(4, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def work(rank):
        x = pieces[rank].clone().requires_grad_()
        summed = reduce_from_tp_region(copy_to_tp_region(x) * (rank + 1))
        scattered = sequence.reduce_scatter_to_sequence_parallel_region(x, 0, None)
        logits = gather_from_tp_region(x, 7)  # 2 x 4 columns, the last one padding
        (summed.sum() + logits.sum()).backward()
        return summed.detach(), scattered.detach(), logits.detach(), x.grad

    with rank_threads(2) as ex:
        (s0, r0, l0, g0), (s1, r1, l1, g1) = run_ranks(ex, work)
    assert torch.equal(s0, s1) and torch.equal(s0, pieces[0] + 2 * pieces[1])
    assert torch.equal(torch.cat([r0, r1]), pieces[0] + pieces[1])  # rank r: rows 2r, 2r + 1
    assert torch.equal(l0, l1) and torch.equal(l0, torch.cat(pieces, -1)[:, :7])
    # f's backward sums the ranks' (r + 1) ones; the gather gives back each rank's columns
    assert torch.equal(g0, torch.full((4, 4), 4.0))
    assert torch.equal(g1[:, :3], torch.full((4, 3), 4.0))
    assert torch.equal(g1[:, 3], torch.full((4,), 3.0))  # the padding column: no gradient


def test_ranks_reaching_different_collectives_fail_instead_of_waiting():
    def work(rank):
        x = torch.ones(2)
        return reduce_from_tp_region(x) if rank == 0 else sequence.all_gather_from_sequence_parallel_region(x, 0)

    with rank_threads(2) as ex, pytest.raises(RankDivergence, match="different collectives"):
        run_ranks(ex, work)


def test_a_rank_that_raises_stops_its_peers_and_is_named():
    def work(rank):
        if rank == 1:
            raise ValueError("rank 1 failed")
        return reduce_from_tp_region(torch.ones(2))  # waits for rank 1: aborted, not hung

    with rank_threads(2) as ex, pytest.raises(ValueError, match="rank 1 failed") as caught:
        run_ranks(ex, work)
    assert caught.value.tp_rank == 1
