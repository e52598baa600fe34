"""runtime/clip.py's ownership over tp, from the plan's layouts alone: over all tp ranks,
the owned runs of a tensor cover every element of the full tensor exactly once: copies of a
kv head (``replicated_heads``, alone or as a fused part) once, padding rows never, a
replicated tensor on tp rank 0 only; over all dp ranks, every expert of a weight split over
ep once (its ``dp / ep`` replicas not again), a DDP-replicated gradient on dp rank 0 only."""
from __future__ import annotations

import pytest

from parallelizer.plan.experts import Experts
from parallelizer.plan.layouts import layout_from_json, segments
from parallelizer.plan.parallel_plan import TensorPlan
from parallelizer.runtime.clip import _dp_owner, _tp_runs

RH = {"kind": "replicated_heads", "heads": 2, "head_dim": 4}
CASES = {  # id -> (shape, tp_dim, layout, tp)
    "even": ((16, 3), 0, None, 4),
    "replicated": ((16,), None, None, 4),
    "kv heads copied (tp 4 > 2 heads)": ((8, 3), 0, RH, 4),
    "falcon fused q | k | v, k and v copied": ((16 + 4 + 4, 3), 0,
        {"kind": "fused", "parts": [16, 4, 4], "part_layouts": [
            None, {"kind": "replicated_heads", "heads": 1, "head_dim": 4},
            {"kind": "replicated_heads", "heads": 1, "head_dim": 4}]}, 4),
    "padded vocabulary": ((10, 3), 0, {"kind": "padded", "padded_size": 12}, 4),
    "fused q | k | v on dim 1": ((3, 12), 1, {"kind": "fused", "parts": [4, 4, 4]}, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_owned_runs_cover_the_full_tensor_once(case):
    shape, tp_dim, layout, tp = CASES[case]
    layout = layout_from_json(layout)  # the plan's typed layout of its JSON form
    t = TensorPlan("w", shape, "float32", tp_dim, (0,), layout=layout)
    n = shape[tp_dim] if tp_dim is not None else shape[0]
    count = [0] * n
    for r in range(tp):
        runs = _tp_runs(t, tp, r)
        if runs is None:
            continue
        if tp_dim is None:
            assert runs == [] and r == 0
            count = [c + 1 for c in count]
            continue
        local = t.local_shape(tp)[tp_dim]
        runs = runs or [(0, local)]
        piece_to_full = {}
        for seg in segments(n, layout, tp, r):
            for i in range(seg.length):
                piece_to_full[seg.piece_offset + i] = seg.full_offset + i
        for start, length in runs:
            for i in range(start, start + length):
                count[piece_to_full[i]] += 1  # padding has no full index: a KeyError
    assert count == [1] * n, (case, count)


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2), (8, 4), (4, 1)])
def test_dp_owners_count_each_expert_once(dp, ep):
    """dp rank d holds experts rows(E, d % ep) (ep rank d % ep of replica d // ep)."""
    n = 8
    t = TensorPlan("w", (n, 3, 5), "float32", None, (0,), experts=Experts(ep) if ep > 1 else None)
    count = [0] * n
    for d in range(dp):
        if _dp_owner(t, d, dp):
            lo, hi = t.experts.rows(n, d % ep) if t.experts else (0, n)
            for i in range(lo, hi):
                count[i] += 1
    assert count == [1] * n, count
