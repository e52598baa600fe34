"""The pipeline step timed on torch's own action lists (advisor/pipeline_sim.py): the textbook
bubbles on equal stages, zero-bubble schedules below 1F1B, the extrapolation to many
microbatches against whole simulations, and the activations a rank holds at its peak.
"""
import random

import pytest

from parallelizer.advisor.pipeline_sim import (StageTimes, _run, _steps, peak_in_flight,
                                               reduced_microbatches, simulate)


@pytest.mark.parametrize("schedule, pp, v, m", [
    ("1f1b", 4, 1, 8), ("gpipe", 4, 1, 8), ("1f1b", 8, 1, 64), ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_1f1b", 4, 4, 16), ("looped_bfs", 4, 2, 8)])
def test_equal_stages_give_the_textbook_bubble(schedule, pp, v, m):
    # Narayanan et al. 2021 §2.2: (p - 1) (t_f + t_b) per stage chunk; interleaving divides the
    # bubble by v in units of a rank's microbatch (v chunks of F + B)
    f, b = 1.0, 2.0
    out = simulate(schedule, pp, v, m, [StageTimes(f, b, 1.0)] * (pp * v), 0.0)
    assert out.bubble == pytest.approx((pp - 1) * (f + b), rel=2e-3)
    assert out.makespan == pytest.approx(m * v * (f + b) + (pp - 1) * (f + b), rel=2e-3)


def test_zero_bubble_schedules_beat_1f1b_and_sends_cost_time():
    stages = [StageTimes(1.0, 2.0, 1.0)] * 8
    one = simulate("interleaved_1f1b", 4, 2, 8, stages, 0.0)
    for schedule in ("zbv", "interleaved_zero_bubble"):
        zb = simulate(schedule, 4, 2, 8, stages, 0.0)
        assert zb.bubble < one.bubble / 2, (schedule, zb, one)
    slow = simulate("1f1b", 4, 1, 8, stages[:4], 0.5)
    fast = simulate("1f1b", 4, 1, 8, stages[:4], 0.0)
    assert slow.makespan > fast.makespan + 3 * 0.5   # at least the fill's three sends


@pytest.mark.parametrize("schedule, pp, v", [("1f1b", 4, 1), ("gpipe", 4, 1), ("interleaved_1f1b", 4, 2),
                                             ("interleaved_zero_bubble", 4, 2), ("dualpipev", 4, 2)])
def test_many_microbatches_extrapolate_the_steady_state(schedule, pp, v):
    rng = random.Random(0)
    for _ in range(3):
        stages = [StageTimes(rng.uniform(0.8, 1.2), rng.uniform(1.6, 2.4), 0.0) for _ in range(pp * v)]
        stages = [StageTimes(s.fwd, s.bwd, 0.5 * s.bwd) for s in stages]
        send = rng.uniform(0.0, 0.2)
        for m in (5 * pp, 6 * pp):
            assert reduced_microbatches(pp, m, schedule)[1] is not None
            whole = _run(_steps(schedule, pp, v, m), stages, send)
            assert simulate(schedule, pp, v, m, stages, send).makespan == pytest.approx(whole, rel=2e-2)
    equal = [StageTimes(1.0, 2.0, 1.0)] * (pp * v)   # exact on equal stages
    whole = _run(_steps(schedule, pp, v, 6 * pp), equal, 0.1)
    assert simulate(schedule, pp, v, 6 * pp, equal, 0.1).makespan == pytest.approx(whole, rel=2e-3)


def test_peak_activations_follow_the_action_order():
    assert peak_in_flight("1f1b", 4, 1, 16) == (4, 3, 2, 1)          # min(p - r, M)
    assert peak_in_flight("gpipe", 4, 1, 8) == (8,) * 4               # every forward first
    # interleaved: rank 0 holds p (1 + (p - 1) / (p v)) stage-microbatches per chunk
    # (Narayanan et al. 2021, §2.2.2): 4 x (1 + 3/8) x 2 chunks = 11
    assert peak_in_flight("interleaved_1f1b", 4, 2, 16)[0] == 11
