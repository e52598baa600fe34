"""The training loop of ``run.py --train``: per optimizer step, ``train.grad_accum`` batches
(one step of ``grad_accum x pipeline.microbatches`` microbatches, the dp reduction once),
the non-finite check, clipping by the global norm (``optimizer.max_norm``,
runtime/clip.py), the optimizer and LR-schedule step (runtime/lr_schedule.py), metrics and
evaluation (runtime/metrics.py), periodic checkpoints.

``--steps`` is the total number of optimizer steps, with or without ``--resume``: a resumed
run continues from the checkpoint's step up to it, as a restarted job reruns the same
command line.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.reader import read_manifest
from ..errors import UserError
from ..plan.parallel_plan import ParallelPlan
from . import rng
from .clip import GradNorm
from .compression import load_state as load_compression_state
from .data_parallel import make_stage_optimizer
from .data_source import make_source
from .loss_scale import LossScaler
from .lr_schedule import load_schedule_state, make_schedule, schedule_state
from .lr_schedule import shape as schedule_shape
from .metrics import Metrics, device_peak, format_row, plan_flops_per_token
from .setup import RankContext
from .step import StepRunner
from .stops import TrainingStopped
from .train import TrainState, load_optimizer_state


@dataclass
class TrainOptions:
    """What run.py's flags add to the plan's settings (docs/run.md)."""
    batch_size: int | None = None
    seq_len: int | None = None
    log_every: int | None = None
    eval_every: int | None = None
    log_dir: Path | None = None
    peak_tflops: float | None = None


def run_train(plan: ParallelPlan, spec: dict, stage, ctx: RankContext, loss_fn, model_module,
              steps: int, resume: Path | None = None, after_step=None,
              options: TrainOptions | None = None):
    """Train up to optimizer step ``steps`` in all (from the ``resume`` checkpoint's step
    when given); returns ``(losses, TrainState, last step number)``, losses being global
    means, on every rank. ``after_step(step, state)`` runs after each step.

    Raises:
        TrainingStopped: a non-finite loss or gradient (nothing of that step is applied).
        DataError, BatchError, UserError: the data or the flags (message names the fix).
    """
    options = options or TrainOptions()
    ocfg = spec["optimizer"]
    accum = spec.get("train", {}).get("grad_accum", 1)
    runner = StepRunner(stage, plan, ctx, loss_fn, grad_accum=accum)
    opt = make_stage_optimizer(stage.parameters(), ocfg["name"], ocfg["lr"], ocfg["weight_decay"],
                               plan.zero_stage, ctx)
    state = TrainState(opt, make_schedule(opt, ocfg, steps), LossScaler(plan.param_dtype), accum)
    start = _resume(state, stage, plan, ctx, resume) if resume is not None else 0
    if start >= steps and ctx.rank == 0:
        print(f"nothing to train: the checkpoint is at step {start} and --steps {steps} counts "
              f"all steps (the first run's too); pass --steps above {start} to train more",
              flush=True)
    evaluator = _evaluator(plan, model_module, spec, ctx, options, runner)
    source = make_source(plan, model_module, spec, ctx, options)
    _same_batches(state, source, resume)
    source.seek(state.data_position)
    norm = GradNorm(stage, plan, ctx)
    metrics = _metrics(plan, ctx, options, model_module) if options.log_every else None
    losses = []
    for step in range(start, steps):
        loss, gnorm, lr, tokens = _one_step(state, runner, source, norm, ocfg, ctx, step + 1)
        losses.append(loss)
        if ctx.rank == 0:  # one write: another rank's line could land between text and newline
            sys.stdout.write(f"step {step + 1} loss {loss:.6f}\n")
            sys.stdout.flush()
        if metrics is not None:
            metrics.step(step + 1, loss, gnorm, lr, tokens)
        if evaluator is not None and (step + 1) % options.eval_every == 0:
            evaluator(step + 1, metrics)
        if after_step is not None:
            after_step(step + 1, state)
    if metrics is not None:
        metrics.close()
    return losses, state, max(start, steps)


def _one_step(state: TrainState, runner: StepRunner, source, norm: GradNorm, ocfg: dict,
              ctx: RankContext, step: int):
    """One optimizer step: (loss, grad norm before clipping, lr used, tokens of all ranks)."""
    opt = state.optimizer
    opt.zero_grad(set_to_none=True)
    batch = source.next_step(state.accum)
    state.data_position += state.accum
    runner.loss_scale = state.scaler.scale
    loss, _ = runner.step(batch, keep_outputs=False)
    state.scaler.unscale_(norm)
    total = norm.norm()
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(total))
    if not finite and state.scaler.skip_step(step, ctx):  # fp16 overflow: a smaller scale
        return loss.item(), float(total), opt.param_groups[0]["lr"], source.tokens_per_step(state.accum)
    if not finite:
        raise _stopped(step, loss, total, norm, ctx)
    state.scaler.update()
    if ocfg.get("max_norm"):
        norm.scale_(torch.clamp(ocfg["max_norm"] / (total + 1e-6), max=1.0))
    lr = opt.param_groups[0]["lr"]
    opt.step()
    state.schedule.step()
    return loss.item(), total.item(), lr, source.tokens_per_step(state.accum)


def _stopped(step: int, loss: torch.Tensor, total: torch.Tensor, norm: GradNorm,
             ctx: RankContext) -> TrainingStopped:
    """The TrainingStopped naming the step, the lowest rank with a non-finite gradient and
    its first such parameter. Collective (every rank calls it at the same step)."""
    name = norm.first_nonfinite()
    world = dist.get_world_size()
    first = torch.tensor([ctx.rank if name else world], device=loss.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    bad = int(first.item())
    what = f"the loss is {loss.item()}" if not torch.isfinite(loss) else \
        f"the loss is {loss.item():.6f} but the gradient norm is {total.item()}"
    where = (f"; the first non-finite gradient is on rank {bad} (pp {ctx.pp_rank}, dp {ctx.dp_rank}, "
             f"tp {ctx.tp_rank}), in {name}" if bad == ctx.rank else "") if bad < world else \
        "; every gradient is finite"
    reporter = bad if bad < world else 0
    message = (f"step {step}: {what}{where}; stopped before the optimizer step (nothing of step "
               f"{step} applied). Lower optimizer.lr, set optimizer.max_norm, or check the data")
    return TrainingStopped(message, reporter)


def _same_batches(state: TrainState, source, resume) -> None:
    """Record what the data position counts; on resume, refuse other batches than the
    checkpoint's (its position counts batches: larger ones skipped data, smaller repeated it).

    Raises:
        UserError: naming both and the fix.
    """
    saved, state.data_batches = state.data_batches, getattr(source, "batches", lambda: None)()
    if saved is None or state.data_batches is None or saved == state.data_batches:
        return
    raise UserError(
        f"--resume {resume}: its data position ({state.data_position} batches) counts batches of "
        f"{saved['batch_size']} x {saved['seq_len']} tokens, this run reads "
        f"{state.data_batches['batch_size']} x {state.data_batches['seq_len']}, so it would skip "
        f"or repeat data; resume with --batch-size {saved['batch_size']} --seq-len "
        f"{saved['seq_len']} (or the same data.batch_size / data.seq_len), or start the data "
        f"anew from its weights with --load")


def _resume(state: TrainState, stage, plan: ParallelPlan, ctx: RankContext, ckpt: Path) -> int:
    """Load the optimizer, schedule, loss-scale and data position of ``ckpt``; its step."""
    start = load_optimizer_state(state.optimizer, stage, plan, ctx, Path(ckpt))
    train = read_manifest(Path(ckpt))["train"]
    if train.get("schedule"):
        if schedule_shape(train["schedule"]) != schedule_shape(schedule_state(state.schedule)):
            raise UserError(
                f"--resume {ckpt}: its learning-rate schedule is not this run's (the decay's "
                f"length or the milestones differ: with optimizer.schedule.decay_steps null the "
                f"decay spans --steps minus the warmup, so another --steps changes it); resume "
                f"with the first run's --steps, or compile with optimizer.schedule.decay_steps "
                f"set to the length wanted")
        load_schedule_state(state.schedule, state.optimizer, train["schedule"])
    else:  # a checkpoint from before schedules: replay the schedule to the step
        for _ in range(start):
            state.schedule.step()
    state.scaler.load(train.get("loss_scale"))
    state.data_position = int(train.get("data_position", start * state.accum))
    state.data_batches = train.get("data_batches")
    if ctx.compression is not None:
        load_compression_state(ctx.compression, plan, Path(ckpt), ctx.rank, ctx.device)
    if ctx.rank == 0:
        print(f"resumed from {ckpt} at step {start}", flush=True)
    return start


def _metrics(plan, ctx, options: TrainOptions, model_module) -> Metrics:
    example = model_module.example_inputs() if model_module is not None else None
    first = (list(example.values()) if isinstance(example, dict) else list(example or ()))[:1]
    tokens = first[0].shape[0] * (first[0].shape[1] if first[0].dim() > 1 else 1) if first else None
    peak = device_peak(ctx.device, plan.param_dtype, options.peak_tflops)
    return Metrics(ctx, options.log_every, options.log_dir, plan_flops_per_token(plan, tokens),
                   peak, dist.get_world_size())


def _evaluator(plan, model_module, spec, ctx, options: TrainOptions, runner: StepRunner):
    """``evaluate(step, metrics)`` for --eval-every (None without it)."""
    if not options.eval_every:
        return None
    data = spec.get("data") or {}
    if not data.get("eval"):
        raise UserError("--eval-every needs a held-out split: set data.eval to a token file "
                        "(.bin/.npy) at compile time (parallelize ... data.eval=PATH)")
    source = make_source(plan, model_module, spec, ctx, options, split="eval")

    accum = runner.microbatches // plan.microbatches  # an eval step has a train step's shape
    n = data.get("eval_batches", 8)

    def evaluate(step: int, metrics) -> None:
        total = 0.0
        source.seek(0)
        with rng.dropout_active(False):
            for _ in range(n):
                total += runner.eval_loss(source.next_step(accum)).item()
        loss = total / n
        row = {"step": step, "eval_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        if metrics is not None:
            metrics.emit(row)
        elif ctx.rank == 0:
            print(format_row(row), flush=True)
    return evaluate
