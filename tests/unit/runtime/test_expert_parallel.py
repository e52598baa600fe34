"""runtime/expert_parallel.py on two real gloo processes: rows dispatched to their experts'
ranks and combined back equal every expert computed on one process, in outputs and in the
gradients of the rows and of each rank's experts, with even and with uneven routing (one
expert receives every row of a rank, another none)."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import warm

E, IN, OUT = 4, 3, 5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routing(kind: str):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(7, IN, generator=g), torch.randn(9, IN, generator=g)]
    if kind == "even":
        ids = [torch.randint(0, E, (7,), generator=g), torch.randint(0, E, (9,), generator=g)]
    else:  # rank 1 sends all its rows to expert 3; expert 1 gets nothing
        ids = [torch.tensor([0, 0, 2, 3, 0, 2, 3]), torch.full((9,), 3)]
    return xs, ids, torch.randn(E, IN, OUT, generator=g)


def _reference(xs, ids, w):
    """Per-rank expert outputs (rows sorted by expert) and the weight gradient of
    sum_r (r + 1) * sum(y_r), all on one process."""
    w = w.clone().requires_grad_(True)
    outs, gx = [], []
    for r, (x, e) in enumerate(zip(xs, ids)):
        e, perm = torch.sort(e)
        x = x[perm].clone().requires_grad_(True)
        y = torch.stack([x[i] @ w[e[i]] for i in range(len(e))])
        (y * (r + 1)).sum().backward()
        outs.append(y.detach())
        gx.append(x.grad)
    return outs, gx, w.grad


def _rank(rank: int, port: int, kind: str, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from parallelizer.runtime import expert_parallel as ep
    try:
        ep.set_ep_group(dist.group.WORLD)
        xs, ids, w = _routing(kind)
        outs, gxs, gw = _reference(xs, ids, w)
        e, perm = torch.sort(ids[rank])
        x = xs[rank][perm].clone().requires_grad_(True)
        offs = torch.cumsum(torch.bincount(e, minlength=E), 0).to(torch.int32)
        route = ep.ep_route(offs, E)
        local_w = w[2 * rank:2 * rank + 2].clone().requires_grad_(True)
        rows, local_offs = ep.ep_dispatch(x, route), ep.ep_local_offsets(route)
        assert local_offs.dtype == torch.int32 and local_offs.numel() == 2
        start, parts = 0, []
        for j, end in enumerate(local_offs.tolist()):
            parts.append(rows[start:end] @ local_w[j])
            start = end
        y = ep.ep_combine(torch.cat(parts), route)
        (y * (rank + 1)).sum().backward()
        errors[rank] = max((y - outs[rank]).abs().max().item(), (x.grad - gxs[rank]).abs().max().item(),
                           (local_w.grad - gw[2 * rank:2 * rank + 2]).abs().max().item())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_dispatch_combine_equal_all_experts_on_one_process(kind):
    # forked from the session's forkserver (tests/warm.py), not from this process: a fork of
    # a process whose OpenMP pool has run can hang in the child's first parallel op
    errors = warm.context().Manager().dict()
    mp.start_processes(_rank, args=(_port(), kind, errors), nprocs=2, start_method="forkserver")
    assert sorted(errors.keys()) == [0, 1]
    assert max(errors.values()) < 1e-6, dict(errors)


def test_offsets_not_one_per_expert_are_refused():
    from parallelizer.runtime.expert_parallel import ep_route
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="3 experts"):
            import parallelizer.runtime.expert_parallel as ep
            ep.set_ep_group(dist.group.WORLD)
            ep_route(torch.tensor([1, 2], dtype=torch.int32), 3)
    finally:
        dist.destroy_process_group()
        ep.set_ep_group(None)
