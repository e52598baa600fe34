"""One training step of this rank's stages: forward, loss, backward (no optimizer step).

pp = 1: a plain forward and backward. pp > 1: ``torch.distributed.pipelining`` runs the
spec's schedule (:mod:`parallelizer.plan.schedules`: gpipe, 1f1b, interleaved_1f1b,
looped_bfs, interleaved_zero_bubble, zbv, dualpipev) over ``microbatches`` microbatches
with ``scale_grads=True``, so gradients are those of the mean loss over the whole batch.
A rank runs one ``PipelineStage`` per local stage (several under interleaved and V
schedules). Weights held by several stages (a tied embedding and LM head) get their
gradients summed over the stages holding them, on one rank or several, so every copy takes
the same update (Megatron-LM keeps tied embeddings equal the same way, with an all-reduce
over the embedding group). Likewise the copies of a GQA kv head held by several tp ranks
(layout ``replicated_heads``): each copy's gradient holds only the contribution of its
rank's query heads, so the gradients are summed over the ranks holding that head, and all
copies take the true gradient's update.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer
from torch.utils._pytree import tree_unflatten

from ..errors import BatchError
from ..plan.schedules import SINGLE_STAGE, schedule_class
from ..plan.layouts import ReplicatedHeads, copied_heads, copied_runs
from ..plan.out_spec import loads as out_spec_loads
from ..plan.parallel_plan import ParallelPlan
from .batching import flatten, index_rows
from .data_parallel import (all_reduce_grads, dense_params, sync_expert_grads,
                            sync_ignored_dense_grads, sync_scalar_grads)
from .pipeline_stage import TimedPipelineStage
from .setup import RankContext
from .stage_builder import LocalStages, local_tensor
from .token_mean import counter, denominators, whole_step_counts
from .vocab_loss import VocabOutputs


class StepRunner:
    def __init__(self, stages, plan: ParallelPlan, ctx: RankContext, loss_fn, schedule: str | None = None,
                 grad_accum: int = 1):
        """``stages``: this rank's :class:`LocalStages` (or its one stage module);
        ``schedule``: a schedule name overriding the plan's (same stage placement);
        ``grad_accum``: batches per step, run as ``grad_accum x pipeline.microbatches``
        microbatches (``train.grad_accum``)."""
        self.microbatches = plan.microbatches * grad_accum
        self.loss_scale = 1.0  # fp16: the dynamic loss scale (runtime/loss_scale.py)
        if isinstance(stages, torch.nn.Module):
            stages = LocalStages(plan.local_stages(ctx.pp_rank) or [0], [stages])
        self.stage, self.plan, self.ctx, self.loss_fn = stages, plan, ctx, loss_fn
        self.schedule_name = schedule or plan.schedule
        self.out_spec = out_spec_loads(plan.out_spec)
        self.pp = plan.mesh["pp"]
        self.has_first = 0 in stages.indices
        self.is_last = plan.num_stages - 1 in stages.indices
        self._schedules: dict = {}
        self._target = None
        self.pipeline_stages: list = []  # the PipelineStages of the last schedule built
        self.tied = _tied_params(stages, plan, ctx)
        self.summed = _replicated_head_params(stages, plan, ctx) + _partial_tp_params(stages, plan, ctx)
        # DDP cannot follow a pipeline schedule's interleaved forwards (data_parallel.py)
        self.manual_dp = plan.zero_stage in (0, 1) and plan.mesh["dp"] > 1 and self.pp > 1
        # vocab_parallel logits: loss_fn sees them Shard(-1) under loss_parallel (runtime/vocab_loss.py)
        self.vocab = VocabOutputs(plan, ctx.mesh["tp"] if plan.vocab_outputs and self.is_last else None)
        # token means divided by the whole step's count (runtime/token_mean.py), on every rank:
        # a stage before the last may compute one (a loss mid-model)
        self.count = counter(plan.token_means["counter"]) if plan.token_means else None

    def step(self, batch, target=None, keep_outputs: bool = True) -> tuple[torch.Tensor, list | None]:
        """Forward and backward of this rank's share ``batch`` (already on device); the
        loss is ``loss_fn(outputs, target)``, with ``target`` = ``batch`` when None (any
        pytree of tensors whose dim 0 is the batch).

        Returns:
            (loss, outputs): the mean loss over the whole global batch (a 0-dim tensor on
            every rank) and, on the rank of the last stage, the flat outputs for ``batch``
            (else None); vocab_parallel logits are this tp rank's columns
            (:meth:`whole_outputs` gathers them).

        Raises:
            BatchError: the batch size is not divisible by the microbatches.
        """
        target = batch if target is None else target
        with self.vocab.context(), self._whole_step_counts(batch, self.microbatches):
            if self.pp == 1:
                loss, outputs = self._local_step(batch, target, keep_outputs)
            else:
                loss, outputs = self._pipeline_step(batch, target)
        if self.manual_dp:  # an expert weight's dp ranks hold other experts: sync_expert_grads
            all_reduce_grads(dense_params(self.stage, self.plan), self.ctx)
        sync_expert_grads(self.stage, self.plan, self.ctx)
        sync_ignored_dense_grads(self.stage, self.plan, self.ctx, self.manual_dp)
        sync_scalar_grads(self.stage, self.plan, self.ctx)
        if self.ctx.compression is not None:
            self.ctx.compression.finish_step()
        self._sync_tied_grads()
        self._sum_shared_grads()
        return self._global_loss(loss), outputs

    @torch.no_grad()
    def eval_loss(self, batch, target=None) -> torch.Tensor:
        """The mean loss of ``batch`` (this rank's share) over the global batch, forward only
        (no gradients; under pp > 1 the schedule's ``eval``). Collective like :meth:`step`."""
        target = batch if target is None else target
        chunks = 1 if self.pp == 1 else self.microbatches  # pp = 1: one forward of the batch
        with self.vocab.context(), self._whole_step_counts(batch, chunks):
            if self.pp == 1:
                flat = flatten(self.plan, batch)
                loss = self.vocab.loss(self.loss_fn, _as_tuple(self.stage.modules[0](*flat)),
                                       self._unflatten, target).detach()
            else:
                flat = flatten(self.plan, batch)
                b = flat[0].shape[0]
                _row_chunks(b, self.microbatches, self.plan, self.ctx.device)
                self._target = target
                schedule, losses = self._schedule(flat), []
                kwargs = {"target": torch.arange(b, device=self.ctx.device), "losses": losses} \
                    if self.is_last else {}
                schedule.eval(*(flat if self.has_first else ()), **kwargs)
                loss = torch.stack([l.detach() for l in losses]).mean() / self.loss_scale \
                    if self.is_last else torch.zeros((), device=self.ctx.device)
        return self._global_loss(loss)

    def _whole_step_counts(self, batch, chunks: int):
        """Within the block the token means divide by the count over the whole global
        batch (runtime/token_mean.py): ``batch`` (this rank's rows) cut into ``chunks``
        chunks as the step runs it, summed over the dp ranks. Collective over dp; a no-op
        for a model without token means."""
        if self.count is None:
            return nullcontext()
        flat = flatten(self.plan, batch)
        rows = _row_chunks(flat[0].shape[0], chunks, self.plan, self.ctx.device)
        parts = [index_rows(flat, r) if r is not None else flat for r in rows]
        dp = self.plan.mesh["dp"]
        return whole_step_counts(denominators(self.count, parts, chunks * dp, self.ctx.device,
                                              self.ctx.group("dp") if dp > 1 else None))

    def whole_outputs(self, outputs: list) -> list:
        """``outputs`` of :meth:`step` with the vocab_parallel logits gathered over tp
        (padding dropped), detached. Collective over tp on the last stage's ranks."""
        with torch.no_grad():
            return self.vocab.whole(outputs)

    def _unflatten(self, flat):
        return tree_unflatten(list(flat), self.out_spec)

    def _loss(self, flat_out, target):
        if self.plan.param_dtype != "fp32":  # the loss in fp32 on bf16/fp16 outputs, as
            # autocast would run cross_entropy (loss_fn runs outside the stage's autocast)
            flat_out = tuple(o.float() if isinstance(o, torch.Tensor) and o.dtype in
                             (torch.bfloat16, torch.float16) else o for o in flat_out)
        loss = self.vocab.loss(self.loss_fn, flat_out, self._unflatten, target)
        return loss.float() * self.loss_scale if self.loss_scale != 1.0 else loss

    def _pipeline_loss(self, output, rows):
        return self._loss(_as_tuple(output), index_rows(self._target, rows))

    def _local_step(self, batch, target, keep_outputs: bool):
        """pp = 1: forward and backward of each of the ``microbatches`` row chunks of
        ``batch``, each loss divided by their number, so the gradients are those of the mean
        loss; the data-parallel reduction runs in the last one's backward only
        (``set_requires_gradient_sync``, DDP and FSDP2)."""
        module, m = self.stage.modules[0], self.microbatches
        flat = flatten(self.plan, batch)
        chunks = _row_chunks(flat[0].shape[0], m, self.plan, self.ctx.device)
        losses, outs = [], []
        try:
            for i, rows in enumerate(chunks):
                _set_grad_sync(self.stage, i == len(chunks) - 1)
                flat_out = _as_tuple(module(*(index_rows(flat, rows) if m > 1 else flat)))
                loss = self._loss(flat_out, index_rows(target, rows) if m > 1 else target)
                (loss / m if m > 1 else loss).backward()
                losses.append(loss.detach() / self.loss_scale)
                if keep_outputs:
                    outs.append([o.detach() if m > 1 and o is not None else o
                                 for o in flat_out])
        finally:
            _set_grad_sync(self.stage, True)
        loss = losses[0] if m == 1 else torch.stack(losses).mean()
        return loss, (_merge_outputs(outs, self.plan) if keep_outputs else None)

    def _schedule(self, flat):
        key = tuple(tuple(t.shape) for t in flat)  # stages infer activation shapes once
        if key not in self._schedules:
            stages = [TimedPipelineStage(module, index, self.plan.num_stages, self.ctx.device,
                                         group=self.ctx.group("pp"))
                      for index, module in self.stage]
            cls = schedule_class(self.schedule_name)
            self._schedules[key] = (cls(stages[0] if self.schedule_name in SINGLE_STAGE else stages,
                                        n_microbatches=self.microbatches,
                                        loss_fn=self._pipeline_loss, scale_grads=True,
                                        output_merge_spec=_merge_spec(self.plan, self.microbatches)), stages)
        schedule, self.pipeline_stages = self._schedules[key]
        return schedule

    def _pipeline_step(self, batch, target):
        flat = flatten(self.plan, batch)
        b = flat[0].shape[0]
        _row_chunks(b, self.microbatches, self.plan, self.ctx.device)  # checks divisibility
        self._target = target
        schedule = self._schedule(flat)
        rows = torch.arange(b, device=self.ctx.device)
        losses: list = []
        kwargs = {"target": rows, "losses": losses} if self.is_last else {}
        out = schedule.step(*(flat if self.has_first else ()), **kwargs)
        if not self.is_last:
            return torch.zeros((), device=self.ctx.device), None
        loss = torch.stack([l.detach() for l in losses]).mean() / self.loss_scale
        return loss, list(_as_tuple(out))

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

    def _sync_tied_grads(self, pick=lambda p: p.grad) -> None:
        """Sum each tied weight's gradient (``pick(param)``: ``.grad``, or what --verify
        sums like it) over its copies: the local ones (two stages on this rank), then over
        the other ranks holding it; every copy gets the sum."""
        for params, group in self.tied:
            grads = [local_tensor(pick(p)) for p in params if pick(p) is not None]
            if not grads:
                continue
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)

    def _sum_shared_grads(self, pick=lambda p: p.grad) -> None:
        """Sum each replicated kv head's gradient over the tp ranks holding a copy (the
        whole tensor, or the rows of a fused tensor's copied parts), and each Partial
        parameter's over the tp ranks (``partial_tp``)."""
        for param, group, run in self.summed:
            grad = pick(param)
            if grad is None:
                continue
            if run is None:
                dist.all_reduce(local_tensor(grad), group=group)
                continue
            rows = _local_run(grad, *run)
            if rows is not None and rows.numel():
                buf = rows.contiguous()
                dist.all_reduce(buf, group=group)
                rows.copy_(buf)


def _replicated_head_params(stage, plan: ParallelPlan, ctx: RankContext) -> list:
    """(parameter, process group over the tp ranks holding the same kv head copy) for
    tensors laid out ``replicated_heads`` (groups from ``plan.grad_sync``, made once)."""
    mine = ctx.my_sync_groups(plan, "replicated_heads")
    out = []
    for name, param in stage.named_parameters():
        tplan = plan.tensors[plan.aliases.get(name, name)]
        layout = tplan.layout
        if isinstance(layout, ReplicatedHeads):  # the whole piece is the copy
            out.append((param, mine[layout.heads], None))
        elif copied_heads(layout):  # a fused q|k|v with copied k / v parts (Falcon)
            d = tplan.tp_dim
            for offset, length, heads in copied_runs(tplan.shape[d], layout, plan.mesh["tp"]):
                out.append((param, mine[heads], (d, offset, length)))
    return out


def _partial_tp_params(stages, plan: ParallelPlan, ctx: RankContext) -> list:
    """(parameter, the tp group, None) for the replicated parameters whose gradient is
    Partial over tp (``plan.grad_sync`` kind ``partial_tp``: each tp rank's gradient holds
    its shard's contribution only; planning/gradients.py). Under FSDP2 each tp rank holds the
    same dp chunk of the whole tensor, so the local chunks are summed."""
    names = {f for e in plan.grad_sync if e["kind"] == "partial_tp" for f in e["key"]}
    if not names:
        return []
    group = ctx.group("tp")
    return [(param, group, None) for name, param in stages.named_parameters()
            if plan.aliases.get(name, name) in names]


def _local_run(grad, dim: int, offset: int, length: int):
    """The rows ``[offset, offset + length)`` along ``dim`` of this rank's tp piece, as a
    view of the local gradient; under FSDP2 (a DTensor sharded on dim 0) only the part inside
    this rank's chunk (None when the chunk holds none of them)."""
    local = local_tensor(grad)
    lo = 0
    if hasattr(grad, "to_local") and dim == 0:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        lo = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh,
                                                   grad.placements)[1][0]
    start, end = max(offset, lo), min(offset + length, lo + local.shape[dim])
    if dim == 0 and end <= start:
        return None
    return local.narrow(dim, start - lo, end - start)


def _row_chunks(b: int, m: int, plan: ParallelPlan, device) -> list:
    """``m`` equal row-index chunks of a batch of ``b`` rows (this rank's share).

    Raises:
        BatchError: ``m`` does not divide ``b``.
    """
    if b % m:
        accum = m // plan.microbatches
        what = f"pipeline.microbatches ({plan.microbatches})" + (
            f" x train.grad_accum ({accum}) = {m} microbatches" if accum > 1 else "")
        raise BatchError(f"this rank's batch size {b} is not divisible by {what}; pass a batch "
                         f"whose size is a multiple of {plan.microbatches} per data-parallel rank "
                         f"(a global batch that is a multiple of mesh.dp ({plan.mesh['dp']}) x "
                         f"{plan.microbatches})")
    return list(torch.arange(b, device=device).chunk(m)) if m > 1 else [None]


def _set_grad_sync(stages, on: bool) -> None:
    """Turn the data-parallel gradient reduction of every local stage on or off (DDP
    ``replicate`` and FSDP2 modules both have ``set_requires_gradient_sync``)."""
    for module in stages.modules:
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(on)


def _merge_outputs(outs: list, plan: ParallelPlan) -> list:
    """The outputs of the microbatches of one step as one: concatenated along dim 0, the
    mean for a 0-dim output (a loss the model computed, ``plan.scalar_outputs``); a None
    leaf (a NamedTuple's unused field) stays None."""
    if len(outs) == 1:
        return list(outs[0])
    return [None if parts[0] is None else torch.stack(parts).mean(0)
            if i in plan.scalar_outputs else torch.cat(parts) for i, parts in enumerate(zip(*outs))]


def _merge_spec(plan: ParallelPlan, m: int | None = None):
    """How the last stage's outputs merge over microbatches: concatenated along dim 0, but a
    0-dim output (a loss the model computed, ``plan.scalar_outputs``) is the mean of the
    microbatches' values, detached (parallelizer/analysis/outputs.py); None: torch's default (all
    concatenated)."""
    if not plan.scalar_outputs:
        return None
    m = m or plan.microbatches
    n = out_spec_loads(plan.out_spec).num_leaves
    mean = _CustomReducer(torch.zeros(()), lambda acc, x: acc + x.detach() / m)
    return tuple(mean if i in plan.scalar_outputs else TensorChunkSpec(0) for i in range(n))


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _tied_params(stages: LocalStages, plan: ParallelPlan, ctx: RankContext) -> list:
    """(local copies of one tied weight, process group over the other ranks holding it or
    None when every copy is on this rank) for weights in several stages (groups from
    ``plan.grad_sync``, made once)."""
    mine = ctx.my_sync_groups(plan, "tied")
    copies: dict = {}
    for name, param in stages.named_parameters():
        tplan = plan.tensors[plan.aliases.get(name, name)]
        if len(tplan.stages) > 1 and not tplan.is_buffer:
            copies.setdefault(tplan.fqn, (tplan.stages, []))[1].append(param)
    # by name: each rank registers its parameters in its own stage's order, and the
    # all-reduces over the ranks holding a weight must come in one order on all of them
    return [(params, mine.get(stage_set)) for _, (stage_set, params) in sorted(copies.items())]
