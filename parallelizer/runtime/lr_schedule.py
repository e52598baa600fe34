"""The learning-rate schedule of ``run.py --train`` (spec ``optimizer.schedule``), built
from torch's own ``lr_scheduler`` classes so a single-device run with the same classes
takes the same learning rates: ``LinearLR`` warmup, then ``LinearLR`` / ``CosineAnnealingLR``
decay to ``min_lr`` (or none: ``constant``), then ``ConstantLR`` at ``min_lr``, composed by
``SequentialLR``. The scheduler steps once per optimizer step (after ``opt.step()``).

Its ``state_dict()`` is plain JSON data (numbers and lists), stored in the checkpoint
manifest's ``train.schedule`` and restored by :func:`load_schedule_state`, which also puts
the restored learning rate back into the optimizer's param groups (the chainable
schedulers compute the next lr from the group's current one).
"""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

FOREVER = 10 ** 12  # ConstantLR's total_iters: the min_lr phase never ends


def make_schedule(opt: torch.optim.Optimizer, ocfg: dict, steps: int):
    """The scheduler of ``ocfg`` (the spec's ``optimizer`` section as a dict) for a run of
    ``steps`` optimizer steps in all (``decay_steps`` null: ``steps - warmup_steps``)."""
    cfg = ocfg.get("schedule") or {}
    lr, warmup = ocfg["lr"], cfg.get("warmup_steps", 0)
    decay, min_lr = cfg.get("decay", "constant"), cfg.get("min_lr", 0.0)
    length = cfg.get("decay_steps") or max(1, steps - warmup)
    phases = []
    if warmup:
        phases.append(LinearLR(opt, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup))
    if decay == "cosine":
        phases.append(CosineAnnealingLR(opt, T_max=length, eta_min=min_lr))
    elif decay == "linear":
        phases.append(LinearLR(opt, start_factor=1.0, end_factor=min_lr / lr, total_iters=length))
    if decay != "constant":
        phases.append(ConstantLR(opt, factor=min_lr / lr, total_iters=FOREVER))
    if not phases:
        return ConstantLR(opt, factor=1.0, total_iters=0)
    if len(phases) == 1:
        return phases[0]
    return SequentialLR(opt, phases, milestones=_milestones(warmup, length, len(phases)))


def _milestones(warmup: int, length: int, n: int) -> list[int]:
    """Where each phase after the first begins: [warmup, warmup + length] with a warmup,
    [length] without (phases: warmup?, decay, min_lr)."""
    starts = ([warmup] if warmup else []) + [warmup + length]
    return starts[:n - 1]


def schedule_state(sched) -> dict:
    """The scheduler's state as JSON data (SequentialLR nests its phases' states)."""
    return sched.state_dict()


def load_schedule_state(sched, opt: torch.optim.Optimizer, state: dict) -> None:
    """Restore ``state`` (from :func:`schedule_state`) into ``sched`` and set every param
    group's lr to the restored one."""
    sched.load_state_dict(state)
    for group, lr in zip(opt.param_groups, sched.get_last_lr()):
        group["lr"] = lr


_SHAPE = ("_milestones", "T_max", "total_iters", "eta_min", "start_factor", "end_factor", "factor")


def shape(state: dict) -> list:
    """What fixes a schedule's curve in :func:`schedule_state`'s data (the phases' lengths and
    factors, the milestones), not where it is: two schedules of one shape give the same lr at
    every step."""
    out = [(k, state[k]) for k in _SHAPE if k in state]
    for inner in state.get("_schedulers", ()):
        out.append(shape(inner))
    return out
