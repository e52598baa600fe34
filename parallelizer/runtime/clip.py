"""The global gradient norm over every mesh dim, and clipping by it (``optimizer.max_norm``,
``pz.clip_grad_norm_``).

Each element of the original model's gradients is counted exactly once over the whole
world, as ``torch.nn.utils.clip_grad_norm_`` of the unmodified model counts it: this rank
sums the squares of the regions of its local gradients it *owns*, and one all-reduce over
all ranks adds them up (Megatron-LM's ``clip_grad_norm_fp32`` reduces over the
model-parallel group the same way; torchtitan's ``clip_grad_norm_`` adds the pp reduction).
Ownership comes from the plan, never from module names:

- pp: a weight held by several stages (``TensorPlan.stages``: a tied embedding and LM head,
  whose copies hold the same summed gradient after the step) is owned by the module of its
  first stage only;
- tp: a ``Replicate`` tensor (``tp_dim`` None) by tp rank 0; a sharded one by the ranks of
  its layout segments (:func:`parallelizer.plan.layouts.segments`), a segment held by
  several ranks (a copied kv head, ``replicated_heads``) by the lowest of them, and padding
  rows (vocabulary padded for tp) by none;
- dp: an FSDP2 shard (a DTensor gradient) by the rank holding it (on a replicated HSDP dim,
  the first replica); a gradient every dp rank holds whole (DDP) by dp rank 0;
- ep: an expert weight (``TensorPlan.experts``, E/ep experts per rank, outside DDP / FSDP2)
  by the ep ranks of the first expert-data-parallel replica, so the squares of every expert
  are summed over the ep group once and the ``dp / ep`` replicas of them are not counted
  again (Megatron-LM's expert-parallel norm: expert parameters reduced over the
  expert-model-parallel group).

Norms are accumulated in float64 and returned as a 0-dim fp32 tensor on every rank.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..plan.layouts import segments
from ..plan.parallel_plan import ParallelPlan
from .setup import RankContext
from .stage_builder import local_tensor


class GradNorm:
    """The owned regions of each local parameter of ``stages`` (:class:`LocalStages`),
    computed once; :meth:`norm` and :meth:`clip_` use them after every backward."""

    def __init__(self, stages, plan: ParallelPlan, ctx: RankContext, owner=None):
        """``owner(tensor_plan, stage_index, param) -> [(dim, start, length)] | None`` (all
        of the local tensor when ``[]``): the ownership rule, :func:`owned_regions` by default."""
        owner = owner or (lambda tplan, s, p: owned_regions(tplan, s, p, plan, ctx))
        self.params: list = []  # (name, param, regions or None = not owned)
        position = {}  # (stage, fqn) -> place in the model's order (the plan's, graph order)
        for st in plan.stages:
            position.update(((st.index, f), (st.index, i)) for i, f in enumerate(st.fqns))
        keys = []
        for index, module in stages:
            for name, p in module.named_parameters():
                fqn = plan.aliases.get(name, name)
                self.params.append((name, p, owner(plan.tensors[fqn], index, p)))
                keys.append(position.get((index, fqn), (index, len(position))))
        self.model_order = [self.params[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]

    def norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global ``norm_type``-norm (2 or inf) of all gradients (None gradients count
        as zero). Collective over all ranks."""
        inf = math.isinf(norm_type)
        if not inf and norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
        # on the device, one all-reduce: no host sync per parameter
        total = torch.zeros((), dtype=torch.float64, device=_device_of(self.params))
        for _, p, regions in self.params:
            if p.grad is None or regions is None:
                continue
            for piece in _pieces(local_tensor(p.grad), regions):
                if not piece.numel():
                    continue
                if inf:
                    total = torch.maximum(total, piece.detach().abs().max().double())
                else:
                    total += piece.detach().double().pow(2).sum()
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        return (total if inf else total.sqrt()).float()

    def clip_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient (every copy) by ``min(1, max_norm / (norm + 1e-6))``, as
        ``torch.nn.utils.clip_grad_norm_``; returns the norm before clipping."""
        total = self.norm(norm_type)
        self.scale_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def scale_(self, factor) -> None:
        """Multiply every local gradient (every copy) by ``factor`` (a number or 0-dim tensor)."""
        for _, p, _ in self.params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.mul_(factor.to(g.device) if isinstance(factor, torch.Tensor) else factor)

    def first_nonfinite(self) -> str | None:
        """The name of this rank's first parameter (in the model's order: pipeline stage,
        then the order the captured graph reads them) whose gradient holds a NaN or an Inf,
        else None. Local: no collective."""
        for name, p, _ in self.model_order:
            if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all():
                return name
        return None


def _device_of(params: list) -> torch.device:
    for _, p, _ in params:
        return local_tensor(p).device
    return torch.device("cpu")


def _pieces(g: torch.Tensor, regions: list):
    if not regions:
        yield g
        return
    for dim, start, length in regions:
        yield g.narrow(dim, start, length)


def owned_regions(tplan, stage_index: int, param, plan: ParallelPlan, ctx: RankContext):
    """The regions ``[(dim, start, length)]`` of this rank's local piece of ``param`` it
    owns (``[]``: all of it; None: none), by the rules of the module docstring."""
    if len(tplan.stages) > 1 and stage_index != tplan.stages[0]:
        return None  # a copy of a weight held by several stages: its first stage owns it
    runs = _tp_runs(tplan, plan.mesh["tp"], ctx.tp_rank)
    if runs is None:
        return None
    dim = None if tplan.tp_dim is None else tplan.tp_dim % len(tplan.shape)
    lo, hi = 0, None
    if hasattr(param, "device_mesh"):  # FSDP2: this rank's chunk of dim 0
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        mesh, placements = param.device_mesh, param.placements
        if any(pl.is_replicate() and mesh.get_local_rank(i) != 0 for i, pl in enumerate(placements)):
            return None
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
        if not len(shape):
            return [] if ctx.dp_rank == 0 and runs == [] else None
        lo, hi = offset[0], offset[0] + shape[0]
        if hi <= lo:
            return None
    elif not _dp_owner(tplan, ctx.dp_rank, plan.mesh["dp"]):
        return None  # another dp rank holds the same reduced gradient
    if runs == []:
        return []
    if dim != 0 or hi is None:
        return [(dim, start, length) for start, length in runs]
    out = []  # runs along dim 0 meet this rank's FSDP chunk [lo, hi)
    for start, length in runs:
        a, b = max(start, lo), min(start + length, hi)
        if b > a:
            out.append((0, a - lo, b - a))
    return out or None


def _dp_owner(tplan, dp_rank: int, dp: int) -> bool:
    """Whether dp rank ``dp_rank`` counts its whole (not FSDP-sharded) gradient of ``tplan``:
    dp rank 0 for a gradient every dp rank holds (DDP); for an expert weight split over ep
    (``tplan.experts``), the ep ranks of the first expert-data-parallel replica (dp ranks
    ``[0, ep)``, each holding other experts; the ``dp / ep`` replicas hold the same sums)."""
    if tplan.experts is None:
        return dp_rank == 0
    ep = tplan.experts.ep
    if dp % ep:
        raise ValueError(f"{tplan.fqn}: ep = {ep} does not divide dp = {dp}")
    return dp_rank < ep


def _tp_runs(tplan, tp: int, tp_rank: int):
    """``[(piece_offset, length)]`` along ``tp_dim`` this tp rank owns (``[]``: the whole
    piece; None: nothing): segments no lower tp rank also holds."""
    if tplan.tp_dim is None or tp == 1:
        return [] if tp_rank == 0 or tplan.tp_dim is not None else None
    n = tplan.shape[tplan.tp_dim % len(tplan.shape)]
    lower = {(s.full_offset, s.length) for r in range(tp_rank)
             for s in segments(n, tplan.layout, tp, r)}
    mine = [(s.piece_offset, s.length) for s in segments(n, tplan.layout, tp, tp_rank)
            if s.length and (s.full_offset, s.length) not in lower]
    whole = tplan.local_shape(tp)[tplan.tp_dim % len(tplan.shape)]
    if mine == [(0, whole)]:
        return []
    return mine or None
