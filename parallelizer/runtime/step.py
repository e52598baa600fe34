"""One training step of this rank's stage: forward, loss, backward (no optimizer step).

pp = 1: a plain forward and backward. pp > 1: ``torch.distributed.pipelining`` runs the
spec's schedule (ScheduleGPipe or Schedule1F1B) over ``microbatches`` microbatches with
``scale_grads=True``, so gradients are those of the mean loss over the whole batch.
Weights held by two stages (a tied embedding and LM head) get their gradients summed over
the stages holding them, so both copies take the same update (Megatron-LM keeps tied
embeddings equal the same way, with an all-reduce over the embedding group). Likewise the
copies of a GQA kv head held by several tp ranks (layout ``replicated_heads``): each copy's
gradient holds only the contribution of its rank's query heads, so the gradients are summed
over the ranks holding that head, and all copies take the true gradient's update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils._pytree import tree_unflatten, treespec_loads

from ..plan import ParallelPlan
from .batching import flatten, index_rows
from .data_parallel import all_reduce_grads
from .setup import RankContext
from .stage_builder import local_tensor

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StepRunner:
    def __init__(self, stage: torch.nn.Module, plan: ParallelPlan, ctx: RankContext, loss_fn):
        self.stage, self.plan, self.ctx, self.loss_fn = stage, plan, ctx, loss_fn
        self.out_spec = treespec_loads(plan.out_spec)
        self.pp = plan.mesh["pp"]
        self.is_last = ctx.pp_rank == self.pp - 1
        self._schedules: dict = {}
        self._target = None
        self.summed = _tied_params(stage, plan, ctx) + _replicated_head_params(stage, plan, ctx)
        # DDP cannot follow a pipeline schedule's interleaved forwards (data_parallel.py)
        self.manual_dp = plan.zero_stage in (0, 1) and plan.mesh["dp"] > 1 and self.pp > 1

    def step(self, batch, target=None) -> tuple[torch.Tensor, list | None]:
        """Forward and backward of this rank's share ``batch`` (already on device); the
        loss is ``loss_fn(outputs, target)``, with ``target`` = ``batch`` when None (any
        pytree of tensors whose dim 0 is the batch).

        Returns:
            (loss, outputs): the mean loss over the whole global batch (a 0-dim tensor on
            every rank) and, on the last stage, the flat outputs for ``batch`` (else None).
        """
        target = batch if target is None else target
        if self.pp == 1:
            flat_out = _as_tuple(self.stage(*flatten(self.plan, batch)))
            loss = self.loss_fn(self._unflatten(flat_out), target)
            loss.backward()
            loss, outputs = loss.detach(), list(flat_out)
        else:
            loss, outputs = self._pipeline_step(batch, target)
        if self.manual_dp:
            all_reduce_grads(self.stage.parameters(), self.ctx)
        self._sum_shared_grads()
        return self._global_loss(loss), outputs

    def _unflatten(self, flat):
        return tree_unflatten(list(flat), self.out_spec)

    def _pipeline_loss(self, output, rows):
        return self.loss_fn(self._unflatten(_as_tuple(output)), index_rows(self._target, rows))

    def _schedule(self, flat):
        key = tuple(tuple(t.shape) for t in flat)  # stages infer activation shapes once
        if key not in self._schedules:
            stage = PipelineStage(self.stage, self.ctx.pp_rank, self.pp, self.ctx.device,
                                  group=self.ctx.group("pp"))
            self._schedules[key] = SCHEDULES[self.plan.schedule](
                stage, n_microbatches=self.plan.microbatches, loss_fn=self._pipeline_loss,
                scale_grads=True)
        return self._schedules[key]

    def _pipeline_step(self, batch, target):
        flat = flatten(self.plan, batch)
        self._target = target
        schedule = self._schedule(flat)
        rows = torch.arange(flat[0].shape[0], device=self.ctx.device)
        losses: list = []
        if self.ctx.pp_rank == 0:
            out = schedule.step(*flat)
        elif self.is_last:
            out = schedule.step(target=rows, losses=losses)
        else:
            out = schedule.step()
        if not self.is_last:
            return torch.zeros((), device=self.ctx.device), None
        return torch.stack([l.detach() for l in losses]).mean(), list(_as_tuple(out))

    def _global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every rank, averaged over data-parallel ranks."""
        loss = loss.detach().clone().float()
        if self.pp > 1:
            if not self.is_last:
                loss.zero_()
            dist.all_reduce(loss, group=self.ctx.group("pp"))
        if self.plan.mesh["dp"] > 1:
            dist.all_reduce(loss, group=self.ctx.group("dp"))
            loss /= self.plan.mesh["dp"]
        return loss

    def _sum_shared_grads(self) -> None:
        for param, group in self.summed:
            if param.grad is not None:
                dist.all_reduce(local_tensor(param.grad), group=group)


def _replicated_head_params(stage, plan: ParallelPlan, ctx: RankContext) -> list:
    """(parameter, process group over the tp ranks holding the same kv head copy) for
    tensors laid out ``replicated_heads``. Every rank creates every group, in the same order."""
    tp = plan.mesh["tp"]
    heads = sorted({t.layout["heads"] for t in plan.tensors.values()
                    if t.layout and t.layout["kind"] == "replicated_heads"})
    mesh = ctx.mesh.mesh  # ranks, shape (pp, dp, tp)
    mine = {}
    for k in heads:
        copies = tp // k
        for p in range(plan.mesh["pp"]):
            for d in range(plan.mesh["dp"]):
                for h in range(k):
                    ranks = [int(mesh[p, d, t]) for t in range(h * copies, (h + 1) * copies)]
                    group = dist.new_group(ranks)
                    if ctx.rank in ranks:
                        mine[k] = group
    out = []
    for name, param in stage.named_parameters():
        layout = plan.tensors[plan.aliases.get(name, name)].layout
        if layout and layout["kind"] == "replicated_heads":
            out.append((param, mine[layout["heads"]]))
    return out


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _tied_params(stage, plan: ParallelPlan, ctx: RankContext) -> list:
    """(parameter, process group over the stages holding it) for weights in several stages.
    Every rank creates every group, in the same order, as ``new_group`` requires."""
    stage_sets = sorted({t.stages for t in plan.tensors.values()
                         if len(t.stages) > 1 and not t.is_buffer})
    mesh = ctx.mesh.mesh  # ranks, shape (pp, dp, tp)
    mine = {}
    for stages in stage_sets:
        for d in range(plan.mesh["dp"]):
            for t in range(plan.mesh["tp"]):
                ranks = [int(mesh[p, d, t]) for p in stages]
                group = dist.new_group(ranks)
                if ctx.rank in ranks:
                    mine[stages] = group
    out = []
    for name, param in stage.named_parameters():
        tplan = plan.tensors[plan.aliases.get(name, name)]
        if tplan.stages in mine:
            out.append((param, mine[tplan.stages]))
    return out
