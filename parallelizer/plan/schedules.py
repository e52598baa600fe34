"""Pipeline schedules by name: which ``torch.distributed.pipelining`` class runs each, how
stages are placed on pp ranks, what each schedule requires, and its theoretical bubble.

Names (``pipeline.schedule``) and the torch classes behind them (the installed torch decides
which exist; :func:`available` lists them):

==========================  ============================  ==========================================
name                        torch class                   source
==========================  ============================  ==========================================
``gpipe``                   ScheduleGPipe                 Huang et al. 2019 (GPipe)
``1f1b``                    Schedule1F1B                  Narayanan et al. 2019 (PipeDream-Flush)
``interleaved_1f1b``        ScheduleInterleaved1F1B       Narayanan et al. 2021 (Megatron-LM), §2.2
``looped_bfs``              ScheduleLoopedBFS             Lamy-Poirier 2023 (Breadth-First PP)
``interleaved_zero_bubble`` ScheduleInterleavedZeroBubble Qi et al. 2024 (Zero Bubble PP), ZB-1P
``zbv``                     ScheduleZBVZeroBubble         Qi et al. 2024, §6 (ZB-V)
``dualpipev``               ScheduleDualPipeV             DeepSeek-V3 report 2024 (DualPipe), V form
==========================  ============================  ==========================================

With ``pp`` ranks and ``v`` = ``pipeline.virtual_stages`` stages per rank the model is cut
into ``pp * v`` stages. Loop placement (every schedule but the V ones): stage ``s`` runs on
rank ``s % pp``. V placement (``zbv``, ``dualpipev``, ``v = 2``): rank ``r`` holds stages ``r``
and ``2 pp - 1 - r``, so the first and the last stage share rank 0. Both are torch's
``generate_stage_to_rank_mapping`` styles ``loop`` and ``v``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..errors import PlanError
from .parallel_plan import grad_sync_groups

TORCH_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SINGLE_STAGE = frozenset({"gpipe", "1f1b"})   # PipelineScheduleSingle: one stage per rank
V_SHAPED = frozenset({"zbv", "dualpipev"})     # exactly 2 stages per rank, V placement
ZERO_BUBBLE = frozenset({"interleaved_zero_bubble", "zbv", "dualpipev"})


def available() -> list[str]:
    """The schedule names the installed torch provides, in the table's order."""
    return [name for name in TORCH_NAMES if schedule_class(name) is not None]


def schedule_class(name: str) -> Optional[type]:
    """The installed torch's class for schedule ``name``, or None when it lacks it."""
    if name not in TORCH_NAMES:
        return None
    from torch.distributed.pipelining import schedules
    try:
        return schedules.get_schedule_class(TORCH_NAMES[name])
    except (ValueError, AttributeError):
        return None


def stage_ranks(schedule: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The pp rank of each of the ``pp * virtual_stages`` stages (loop or V placement)."""
    n = pp * virtual_stages
    if schedule in V_SHAPED:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))


def compute_actions(schedule: str, pp: int, virtual_stages: int,
                    microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per pp rank, in order: the compute actions of torch's own schedule, as
    ``(kind, stage_index, microbatch)`` with ``kind`` one of ``F`` (forward), ``B`` (full
    backward), ``I`` (input gradient), ``W`` (weight gradient). These are the schedule
    class's ``pipeline_order`` (``_schedule_visualizer.get_schedule_ops``); an overlapped
    ``F+B`` pair (dualpipev) is listed as its forward, then its backward. Idle slots and
    gradient reductions are dropped; microbatch numbers are torch's (its 1F1B numbers the
    last rank's forwards from 1).

    Raises:
        ValueError: the installed torch has no class for ``schedule``.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    cls = schedule_class(schedule)
    if cls is None:
        raise ValueError(f"the installed torch has no schedule class for '{schedule}'")
    single = issubclass(cls, PipelineScheduleSingle)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    try:
        order = _pipeline_order(cls, single, pp, microbatches, virtual_stages)
    except AttributeError:  # a torch whose schedules read more of a stage: its own mock
        order = get_schedule_ops(cls, pp, microbatches, None if single else virtual_stages)
    out, kind_of = [], {}
    for actions in order:
        flat = [s for a in actions if a is not None for s in (a.sub_actions or (a,))]
        mine = []
        for a in flat:
            t = a.computation_type  # an enum member: its .name is slow in a loop this long
            if t not in kind_of:
                kind_of[t] = kinds.get(t.name)
            if kind_of[t] is not None:
                mine.append((kind_of[t], a.stage_index, a.microbatch_index))
        out.append(mine)
    return out


class _Stage:
    """What a schedule's constructor reads of its stages, for :func:`_pipeline_order`; any
    other attribute raises AttributeError."""

    def __init__(self, pp: int, num_stages: int):
        self.group_rank, self.group_size, self.num_stages, self.submod = 0, pp, num_stages, None


def _pipeline_order(cls, single: bool, pp: int, microbatches: int, virtual_stages: int) -> list:
    """``cls(stages, microbatches).pipeline_order`` per pp rank: what torch's
    ``_schedule_visualizer.get_schedule_ops`` returns, built on plain stand-in stages instead
    of its ``mock.create_autospec(PipelineStage)``, and without the lowering of the order to
    send / receive / reduce actions that the runtime schedules do at the end of their
    constructor (``_prepare_schedule_with_comms``: it reads the compute actions and leaves
    them as they are). The mock and the lowering took most of the planner's search time; the
    action lists are the same (tests/unit/plan/test_schedules.py)."""
    n = pp * (1 if single else virtual_stages)
    stages = _Stage(pp, n) if single else [_Stage(pp, n) for _ in range(virtual_stages)]
    order = _compute_only(cls)(stages, microbatches).pipeline_order
    return [order[rank] for rank in range(pp)]


_COMPUTE_ONLY: dict = {}


def _compute_only(cls):
    """``cls`` with ``_prepare_schedule_with_comms`` validating the stage mapping only."""
    if not hasattr(cls, "_prepare_schedule_with_comms"):
        return cls
    if cls not in _COMPUTE_ONLY:
        def prepare(self, actions, format="compute_only"):
            self._validate_and_set_stage_mapping(actions)
        _COMPUTE_ONLY[cls] = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": prepare})
    return _COMPUTE_ONLY[cls]


def check(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> Optional[str]:
    """Why this combination cannot run, as one message naming the spec keys and the
    numbers, or None when it can. Mirrors the installed torch's own checks (schedules.py),
    which otherwise fail only when the schedule is built on the cluster."""
    names = available()
    if schedule not in names:
        import torch
        why = "is not provided by" if schedule in TORCH_NAMES else "is not a schedule of"
        return (f"pipeline.schedule '{schedule}' {why} the installed torch {torch.__version__}; "
                f"use one of {', '.join(repr(n) for n in names)}")
    v, m = virtual_stages, microbatches
    if pp == 1:
        return None if v == 1 else (f"pipeline.virtual_stages ({v}) needs mesh.pp > 1 "
                                    f"(mesh.pp is 1); set pipeline.virtual_stages=1 or mesh.pp >= 2")
    if schedule in SINGLE_STAGE and v != 1:
        return (f"pipeline.schedule '{schedule}' runs one stage per rank but "
                f"pipeline.virtual_stages is {v}; set pipeline.virtual_stages=1 or use "
                f"interleaved_1f1b / looped_bfs / interleaved_zero_bubble")
    if schedule in ("interleaved_1f1b", "looped_bfs") and v < 2:
        return (f"pipeline.schedule '{schedule}' needs pipeline.virtual_stages >= 2 (got {v}); "
                f"with one stage per rank use {'1f1b' if schedule == 'interleaved_1f1b' else 'gpipe'}")
    if schedule in V_SHAPED and v != 2:
        return (f"pipeline.schedule '{schedule}' needs exactly 2 stages per rank: set "
                f"pipeline.virtual_stages=2 (got {v})")
    return _check_microbatches(schedule, pp, v, m)


def _check_microbatches(schedule: str, pp: int, v: int, m: int) -> Optional[str]:
    fix = "set pipeline.microbatches"
    if schedule == "1f1b" and m < pp:
        # every schedule needs a microbatch per stage (planning/pipeline_summary.py): no
        # other schedule is the way out (it named gpipe, refused next: a break test)
        return (f"pipeline.microbatches ({m}) must be >= mesh.pp ({pp}) for schedule '1f1b'; "
                f"{fix}={pp} or more (>= {2 * pp} keeps the pipeline bubble at most a third "
                f"of the step).")
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"pipeline.microbatches ({m}) must be a multiple of the number of rounds "
                    f"max(1, microbatches // mesh.pp) = {rounds} for schedule '{schedule}' "
                    f"(mesh.pp {pp}); {fix} to a multiple of mesh.pp, e.g. {rounds * pp}")
    if schedule == "dualpipev" and m < 2 * pp:
        return (f"pipeline.microbatches ({m}) must be >= the number of stages 2 * mesh.pp = "
                f"{2 * pp} for schedule 'dualpipev'; {fix}={2 * pp} or more")
    return None


def bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, *,
           upper_bound: bool = True) -> Optional[float]:
    """Idle fraction of a step with equal stage costs, (P-1)/(M+P-1) for GPipe and 1F1B
    (Huang et al. 2019, §2.2; Narayanan et al. 2021, §2.2.1), (P-1)/(v*M+P-1) with v stages
    per rank for interleaved schedules (Narayanan et al. 2021, §2.2.2); 0 for pp = 1. For
    the zero-bubble schedules the formula is an upper bound: their bubble depends on the
    ratio of input- and weight-gradient times (Qi et al. 2024, §3), so ``upper_bound=False``
    gives None for them (run.py --profile's "theoretical")."""
    if pp <= 1:
        return 0.0
    if schedule in ZERO_BUBBLE and not upper_bound:
        return None
    v = 1 if schedule in SINGLE_STAGE else max(1, virtual_stages)
    return (pp - 1) / (v * microbatches + pp - 1)


def with_schedule(plan, schedule: str):
    """``plan`` run by another schedule: same stages (so the same program files and
    checkpoint), placed on ranks as ``schedule`` needs. Lets ``run.py --schedule`` compare
    schedules without recompiling.

    Raises:
        PlanError: ``schedule`` cannot run this plan's ``pp`` x ``virtual_stages`` x
            ``microbatches`` (the message names the numbers and the fix).
    """
    pp, v = plan.mesh["pp"], plan.virtual_stages
    problem = check(schedule, pp, v, plan.microbatches)
    if problem:
        raise PlanError(f"this program (mesh.pp {pp}, pipeline.virtual_stages {v}, "
                        f"pipeline.microbatches {plan.microbatches}) cannot run schedule "
                        f"'{schedule}': {problem}; recompile with those keys changed")
    ranks = stage_ranks(schedule, pp, v)
    placed = replace(plan, schedule=schedule,
                     stages=tuple(replace(st, rank=r) for st, r in zip(plan.stages, ranks)))
    return replace(placed, grad_sync=grad_sync_groups(placed))
