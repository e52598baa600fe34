"""Gather a local (FSDP- and tp-sharded) tensor back to its full shape."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.layouts import copied_heads, copied_runs, segments
from ..plan.parallel_plan import TensorPlan
from .setup import RankContext


def copies_max_diff(t: torch.Tensor, tplan: TensorPlan, ctx: RankContext, tp: int) -> float:
    """Max abs difference between the tp ranks' copies of a ``replicated_heads`` tensor (or
    of a fused tensor's copied parts) and the first copy of the same head (0.0 for other
    layouts). Collective over tp."""
    layout = tplan.layout
    if not copied_heads(layout) or tp == 1:
        return 0.0
    t = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t, group=ctx.group("tp"))
    d = tplan.tp_dim % t.dim()
    spread = 0.0
    for offset, length, heads in copied_runs(tplan.shape[d], layout, tp):
        copies = tp // heads
        for r in range(tp):
            a = parts[r].narrow(d, offset, length)
            b = parts[r - r % copies].narrow(d, offset, length)
            if a.numel():
                spread = max(spread, (a - b).abs().max().item())
    return spread


def full_tensor(t: torch.Tensor, tplan: TensorPlan, ctx: RankContext, tp: int) -> torch.Tensor:
    """All-gather over dp (FSDP2's DTensor ``full_tensor``), over ep for an expert weight
    (concatenated along its experts dim), then over tp (concatenated along ``tplan.tp_dim``). Collective: every rank of the stage calls it in the same order."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    t = t.detach()
    if tplan.experts is not None:  # this ep rank's experts: all-gather them along dim 0
        parts = [torch.empty_like(t) for _ in range(tplan.experts.ep)]
        dist.all_gather(parts, t.contiguous(), group=ctx.ep_mesh["ep"].get_group())
        t = torch.cat(parts, dim=tplan.experts.dim)
    if tplan.tp_dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group("tp"))
    if tplan.layout is None:
        return torch.cat(parts, dim=tplan.tp_dim)
    d = tplan.tp_dim % t.dim()  # fused / replicated heads / padded: place each segment
    full = t.new_empty(tplan.shape)
    for r, part in enumerate(parts):
        for seg in segments(tplan.shape[d], tplan.layout, tp, r):
            full.narrow(d, seg.full_offset, seg.length).copy_(part.narrow(d, seg.piece_offset, seg.length))
    return full
