"""Gather a local (FSDP- and tp-sharded) tensor back to its full shape."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layouts import segments
from ..plan import TensorPlan
from .setup import RankContext


def full_tensor(t: torch.Tensor, tplan: TensorPlan, ctx: RankContext, tp: int) -> torch.Tensor:
    """All-gather over dp (FSDP2's DTensor ``full_tensor``) then over tp, each tp rank's
    piece placed where ``tplan.layout`` says it came from (:mod:`parallelizer.layouts`;
    concatenation along ``tplan.tp_dim`` for the even split; for replicated heads the copies
    agree, the last one is kept). Collective: every rank of the stage calls it in the same
    order."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    t = t.detach()
    if tplan.tp_dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group("tp"))
    if tplan.layout is None:
        return torch.cat(parts, dim=tplan.tp_dim)
    d = tplan.tp_dim % t.dim()
    full = t.new_zeros(tplan.shape)
    for rank, part in enumerate(parts):
        for seg in segments(tplan.shape[d], tplan.layout, tp, rank):
            full.narrow(d, seg.full_offset, seg.length).copy_(part.narrow(d, seg.piece_offset, seg.length))
    return full
