"""A pipeline step timed on the schedule's own action lists.

Each pp rank runs torch's ``pipeline_order`` for the schedule
(:func:`parallelizer.plan.schedules.compute_actions`: ``F`` forward, ``B`` full backward,
``I`` input gradient, ``W`` weight gradient, per stage and microbatch) one action after the
other. An action starts when its rank is free and its input has arrived: ``F`` of stage s
needs ``F`` of stage s-1 for the same microbatch, ``B`` / ``I`` of stage s needs the input
gradient from stage s+1 (``B`` or ``I``), the last stage's backward its own forward, ``W``
its ``I``; a value crossing ranks arrives ``send_s`` after it was produced. The step's
pipeline time is the latest finish; each rank's bubble is that minus its own busy time.
This covers every schedule torch provides (GPipe, 1F1B, interleaved, looped BFS, the
zero-bubble ones with their split backward, DualPipeV) without a formula per schedule.

For many microbatches the action lists of the steady state repeat every pp microbatches: the
step is simulated at two microbatch counts a pp apart (:func:`reduced_microbatches`) and
extended linearly to M: exact on equal stages, within 2 % of a whole simulation on stages
20 % apart with sends (tests/unit/advisor/test_pipeline_sim.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..plan.schedules import SINGLE_STAGE, compute_actions, stage_ranks


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one microbatch on one stage: forward, full backward, and the backward's
    weight-gradient part (the ``W`` action when the schedule splits it; ``I`` = B - W)."""
    fwd: float
    bwd: float
    wgrad: float = 0.0


@dataclass(frozen=True)
class PipelineTime:
    makespan: float          # seconds from the first action to the last
    busy: tuple              # per pp rank: seconds of its own actions
    bubble: float            # makespan - busy of the busiest rank


@lru_cache(maxsize=4096)
def _actions(schedule: str, pp: int, v: int, m: int):
    """The action lists, microbatches renumbered in order per (stage, kind): every schedule
    runs a stage's forwards (and backwards, full or input-gradient) in microbatch order, and
    the visualizer numbers
    the last rank's 1F1B forwards from 1."""
    out = []
    for actions in compute_actions(schedule, pp, v, m):
        count: dict = {}
        split: dict = {}  # stage -> backward numbers of its I actions, in order (W follows them)
        mine = []
        for kind, stage, _ in actions:
            if kind == "W":
                k = split[stage].pop(0)
            else:
                group = "B" if kind in ("B", "I") else kind  # a stage's backwards, full or split
                k = count.get((group, stage), 0)
                count[(group, stage)] = k + 1
                if kind == "I":
                    split.setdefault(stage, []).append(k)
            mine.append((kind, stage, k))
        out.append(tuple(mine))
    return tuple(out)


def reduced_microbatches(pp: int, m: int, schedule: str = "") -> tuple[int, int | None]:
    """The two microbatch counts simulated for ``m`` when it is large, ``m1 = k pp + r`` and
    ``m2 = (k + 1) pp + r`` (k = 3 up to pp = 8, else 2: the action lists grow as pp x m;
    r = m mod pp, 0 for one stage per rank, whose steady state has no rounds), or (m, None)
    when m <= m2 is simulated whole."""
    k = 3 if pp <= 8 else 2
    r = 0 if schedule in SINGLE_STAGE else m % pp
    m2 = (k + 1) * pp + r
    return (m, None) if m <= m2 else (k * pp + r, m2)


_SIMS: dict = {}
_QUANTUM = 1e-3  # stage times are cached relative to the longest stage, to 0.1 %


def simulate(schedule: str, pp: int, v: int, m: int, stages: list[StageTimes],
             send_s: float, uniform: bool = False) -> PipelineTime:
    """The step of ``m`` microbatches over ``pp`` ranks with ``len(stages)`` = pp x v stages
    (module docstring); ``uniform``: every stage taking the busiest one's times (a fast,
    slightly pessimistic screen). Simulations are cached on the stage times relative to the
    longest stage (rounded to 0.1 %), which the search's layouts share."""
    if uniform:  # every stage as the busiest: the search's screening pass
        top = max(stages, key=lambda st: st.fwd + st.bwd)
        stages = [top] * len(stages)
    unit = max(st.fwd + st.bwd for st in stages) or 1.0
    quantum = _QUANTUM * (5 if uniform else 1)
    q = lambda x: round(x / unit / quantum)  # noqa: E731
    key = (schedule, pp, v, m, uniform, tuple((q(st.fwd), q(st.bwd), q(st.wgrad)) for st in stages), q(send_s))
    hit = _SIMS.get(key)
    if hit is None:
        if len(_SIMS) > 20000:
            _SIMS.clear()
        norm = [StageTimes(*(x * quantum for x in k)) for k in key[5]]
        hit = _SIMS[key] = _simulate(schedule, pp, v, m, norm, key[6] * quantum)
    return PipelineTime(hit.makespan * unit, tuple(b * unit for b in hit.busy), hit.bubble * unit)


def _simulate(schedule, pp, v, m, stages, send_s) -> PipelineTime:
    ranks = stage_ranks(schedule, pp, v)
    per_mb = [0.0] * pp
    for s, st in enumerate(stages):
        per_mb[ranks[s]] += st.fwd + st.bwd
    busy = tuple(m * p for p in per_mb)
    m1, m2 = reduced_microbatches(pp, m, schedule)
    if m2 is None:
        makespan = _run(_steps(schedule, pp, v, m), stages, send_s)
    else:
        a = _run(_steps(schedule, pp, v, m1), stages, send_s)
        b = _run(_steps(schedule, pp, v, m2), stages, send_s)
        # no rank finishes before its own work: the linear extension can undershoot that
        # by a fraction of a round where the steady state has no idle slot (zero bubble)
        makespan = max(b + (m - m2) * (b - a) / (m2 - m1), max(busy))
    return PipelineTime(makespan, busy, makespan - max(busy))


@lru_cache(maxsize=4096)
def _graph(schedule: str, pp: int, v: int, m: int) -> tuple:
    """The actions in an order that respects every dependency, each as (rank, kind, stage,
    index of the previous action on its rank or -1, index of the action it waits for or -1,
    whether that one ran on another rank)."""
    actions = _actions(schedule, pp, v, m)
    ranks = stage_ranks(schedule, pp, v)
    last = pp * v - 1
    index: dict = {}
    out: list = []
    pos = [0] * pp
    prev = [-1] * pp
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                kind, s, mb = actions[r][pos[r]]
                dep = _dependency(kind, s, mb, last)
                if dep is not None and dep not in index:
                    if kind == "B" or kind == "I":  # the next stage may have run a split backward
                        alt = (("I" if dep[0] == "B" else "B"),) + dep[1:]
                        dep = alt if alt in index else dep
                    if dep not in index:
                        break
                j = index[dep] if dep is not None else -1
                cross = j >= 0 and ranks[dep[1]] != r
                index[(kind, s, mb)] = len(out)
                out.append((r, kind, s, prev[r], j, cross))
                prev[r] = len(out) - 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [actions[r][pos[r]] for r in range(pp) if pos[r] < len(actions[r])]
            raise RuntimeError(f"pipeline simulation of {schedule} stalled at {stuck[:4]}")
    return tuple(out)


def _dependency(kind, s, mb, last):
    if kind == "F":
        return None if s == 0 else ("F", s - 1, mb)
    if kind == "W":
        return ("I", s, mb)
    return ("F", s, mb) if s == last else ("B", s + 1, mb)


_KINDS = {"F": 0, "B": 1, "I": 2, "W": 3}


@lru_cache(maxsize=4096)
def _steps(schedule: str, pp: int, v: int, m: int) -> tuple:
    """:func:`_graph` as ``(prev, dep, cross, duration index)`` per action for :func:`_run`:
    -1 (no predecessor) reads the sentinel finish time 0 at the end of its list, ``cross``
    is 0 or 1, the duration index is ``4 * stage + kind`` (F, B, I, W)."""
    return tuple((prev, dep, int(cross), 4 * s + _KINDS[kind])
                 for _, kind, s, prev, dep, cross in _graph(schedule, pp, v, m))


def _run(steps, stages, send_s) -> float:
    """The latest finish of the actions of :func:`_steps`: each starts when its rank's
    previous action has finished and its input has arrived (``send_s`` later from another
    rank)."""
    finish = [0.0] * (len(steps) + 1)  # the last entry: the finish of "no action"
    send = (0.0, send_s)
    durations = [d for st in stages for d in (st.fwd, st.bwd, st.bwd - st.wgrad, st.wgrad)]
    for i, (prev, dep, cross, k) in enumerate(steps):
        free, ready = finish[prev], finish[dep] + send[cross]
        finish[i] = (ready if ready > free else free) + durations[k]
    return max(finish)


@lru_cache(maxsize=4096)
def peak_in_flight(schedule: str, pp: int, v: int, m: int) -> tuple:
    """Per pp rank, the most (stage, microbatch) forward activations it holds at once in its
    action order: a forward adds one, a full backward or a weight-gradient action frees it
    (what ``parallelizer/advisor/memory.py`` walks for the compiled program)."""
    out = []
    for actions in _actions(schedule, pp, v, min(m, reduced_microbatches(pp, m, schedule)[1] or m)):
        held = peak = 0
        for kind, _, _ in actions:
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind in ("B", "W"):
                held -= 1
        out.append(peak)
    return tuple(out)
