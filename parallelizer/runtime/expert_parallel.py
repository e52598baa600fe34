"""Expert-parallel token dispatch and combine (GShard, Lepikhin et al. 2020, §2.2; dropless,
as MegaBlocks, Gale et al. 2023, and torchtitan's ``expert_parallel.py`` run it).

The experts of one mixture-of-experts layer are split over the ``ep`` ranks: ep rank ``r``
holds experts ``[r E/ep, (r + 1) E/ep)`` (the stacked weights' rows, layout
:class:`parallelizer.plan.experts.Experts`). Inside the layer the model has already sorted
its (token, expert) rows by expert and counted them (``offs``: the cumulative row counts per
expert, what a grouped matmul reads). The emitted stage then calls, around the model's own
per-expert computation:

``route = ep_route(offs, E)``
    exchanges the per-expert row counts with every ep rank (one small all-to-all: dropless,
    the split sizes are whatever the router chose, no capacity factor);
``ep_local_offsets(route)``
    the cumulative counts of this rank's E/ep experts over the rows it receives;
``ep_dispatch(x, route)``
    sends each row to the rank of its expert (``all_to_all_single`` with variable splits) and
    regroups the received rows by local expert; backward is the reverse all-to-all;
``ep_combine(y, route)``
    the inverse: rows back to the rank and position they came from; backward dispatches.

Rows stay in the model's order on their own rank, so the model's weighting, un-permuting and
top-k sum (the combine it wrote) run unchanged after ``ep_combine``: outputs and gradients
equal the unsharded layer's up to summation order. Shapes: ``x`` (S, ...) with S =
``offs[-1]`` rows sorted by expert; ``ep_dispatch`` returns (R, ...), R the rows this rank's
experts receive; ``ep_combine`` takes (R, ...) and returns (S, ...).

The ep process group is set once per process (:func:`set_ep_group`), as the tp group is.
Without one, under :func:`balanced_shapes` (``parallelize estimate``'s forward on
FakeTensors), the same calls give one rank's shapes under balanced routing and record the
all-to-all buffers' bytes.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

_EP_GROUP = None


def set_ep_group(group) -> None:
    """Use ``group`` (the ranks that split one layer's experts) for dispatch and combine."""
    global _EP_GROUP
    _EP_GROUP = group


def ep_group():
    return _EP_GROUP


class BalancedShapes:
    """Routing without a process group, for shapes and bytes only: every ep rank receives as
    many rows as it sends (the router's load balanced, what its auxiliary loss aims at;
    dropless routing can receive up to ``ep`` times that). ``peak``: the largest
    dispatch or combine, in bytes: its send buffer, the all-to-all's receive buffer and the
    rows regrouped by expert (or back into place), alive together."""

    def __init__(self, ep: int):
        self.ep, self.sizes = ep, []

    def record(self, x: torch.Tensor) -> None:
        """Keep the bytes of one dispatch or combine (a SymInt where the model counts the rows
        at run time: per-module experts; the caller gives it a value, see ``peak``)."""
        self.sizes.append(3 * x.numel() * x.element_size())

    def peak(self, value=int) -> int:
        """The largest recorded buffer, each size made an int by ``value``."""
        return max((value(s) for s in self.sizes), default=0)


_BALANCED: BalancedShapes | None = None


@contextmanager
def balanced_shapes(ep: int):
    """Within: ep_route / ep_dispatch / ep_combine without collectives (see
    :class:`BalancedShapes`, which the context yields)."""
    global _BALANCED
    before, _BALANCED = _BALANCED, BalancedShapes(ep)
    try:
        yield _BALANCED
    finally:
        _BALANCED = before


@dataclass
class Route:
    """One layer's exchange plan on this rank, for one forward (and its backward).

    Attributes:
        send: rows sent to each ep rank (this rank's rows of that rank's experts).
        recv: rows received from each ep rank.
        order: (R,) index: row ``i`` of the expert-grouped local input is row ``order[i]``
            of the received rows (grouped by source rank, then by expert).
        local_offsets: (E/ep,) cumulative received rows per local expert, ``offs``' dtype.
    """

    send: list
    recv: list
    order: torch.Tensor
    local_offsets: torch.Tensor


def ep_route(offs: torch.Tensor, num_experts: int) -> Route:
    """The exchange plan of a layer whose ``offs`` (E,) are cumulative rows per expert.
    Collective over the ep group (the counts' all-to-all).

    Raises:
        ValueError: ``num_experts`` is not a multiple of the ep group's size (the planner
            refuses it first, naming ``mesh.ep``).
    """
    ep = _BALANCED.ep if _BALANCED is not None else dist.get_world_size(_EP_GROUP)
    if num_experts % ep or offs.numel() != num_experts:
        raise ValueError(f"{num_experts} experts (offs of {offs.numel()}) over ep = {ep} ranks")
    local = num_experts // ep
    if _BALANCED is not None:  # shapes only: rows stay as many, in place
        return Route(None, None, None, offs.new_zeros(local))
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())  # (E,) rows per expert
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts.contiguous(), group=_EP_GROUP)  # got[s*local + j]: from s, for my j
    got = got.view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    recv = got.sum(1).tolist()
    # received rows are blocks (source s, local expert j) in s-major order: regroup j-major
    starts = torch.cumsum(got.flatten(), 0) - got.flatten()
    starts, sizes = starts.view(ep, local).t().flatten(), got.t().flatten()
    order = (torch.repeat_interleave(starts - torch.cumsum(sizes, 0) + sizes, sizes)
             + torch.arange(int(sizes.sum()), device=offs.device))
    local_offsets = torch.cumsum(got.sum(0), 0).to(offs.dtype)
    return Route(send, recv, order, local_offsets)


def ep_local_offsets(route: Route) -> torch.Tensor:
    """(E/ep,) cumulative rows per local expert: the ``offs`` of the local grouped matmuls."""
    return route.local_offsets


def ep_dispatch(x: torch.Tensor, route: Route) -> torch.Tensor:
    """(S, ...) rows sorted by expert -> (R, ...) rows of this rank's experts, grouped by
    local expert. Differentiable (backward: the reverse all-to-all)."""
    if route.send is None:
        return _balanced(x)
    return _all_to_all(x, route.recv, route.send)[route.order]


def ep_combine(y: torch.Tensor, route: Route) -> torch.Tensor:
    """(R, ...) outputs of the local experts -> (S, ...) back on the rows' own ranks, in the
    order :func:`ep_dispatch` took them. Differentiable (backward dispatches)."""
    if route.send is None:
        return _balanced(y)
    return _all_to_all(_scatter_rows(y, route.order), route.send, route.recv)


def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list) -> torch.Tensor:
    """torch's differentiable ``all_to_all_single`` (functional collectives; backward is the
    all-to-all with the splits swapped), waited on at once."""
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, _EP_GROUP))


def _scatter_rows(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``z`` with ``z[order] = y`` (the inverse permutation), differentiable."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse]


def _balanced(x: torch.Tensor) -> torch.Tensor:
    """Under :func:`balanced_shapes`: the rows as they arrive (as many as sent), through a
    row index as the real regrouping (so autograd saves the same index)."""
    _BALANCED.record(x)
    return x.clone()[torch.arange(x.shape[0], device=x.device)]
