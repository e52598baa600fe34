"""The layout search (advisor/search.py): bubble and memory follow the schedule, a 1024-GPU
search is fast and keeps tp in a node, no fitting layout is a user error.
"""
import time

import pytest

from parallelizer.errors import UserError
from parallelizer.advisor.cluster import cluster_from_dict
from parallelizer.advisor.search import search, why
from parallelizer.advisor.step_time import Candidate, predict, step_model
from parallelizer.advisor.workload import from_shape, parse_shape

A100 = dict(nodes=4, gpus_per_node=8, gpu="a100-80gb", inter_node={"bandwidth_gb_s": 25, "latency_us": 5})
GPT3 = "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"
LLAMA70B = "layers=80,hidden=8192,heads=64,vocab=128256,seq=4096,ffn=28672,kv_heads=8,glu=1"


# --- search ---------------------------------------------------------------------------------

def test_pipeline_bubble_and_memory_follow_the_schedule():
    w = from_shape(parse_shape("layers=16,hidden=4096,heads=32,vocab=51200,seq=2048"))
    c = cluster_from_dict(A100)
    p4 = predict(w, c, Candidate(1, 4, 8, 1, 16))
    # 1F1B: the busiest rank (the last: four blocks, the head and the loss) idles while the
    # other p - 1 stages fill and drain, one microbatch's forward and backward each
    model = step_model(w, c)
    costs = [model.stages.stage(r, 1, 1, False, False) for r in model.parts(4)]
    assert p4.breakdown["busiest_pp_rank"] == 3
    assert p4.terms["bubble"] == pytest.approx(sum(s.fwd_s + s.bwd_s for s in costs[:3]), rel=1e-3)
    inter = predict(w, c, Candidate(1, 4, 8, 1, 16, virtual_stages=2))
    assert inter.terms["bubble"] < p4.terms["bubble"] * 0.55    # (p-1)/v
    z = [predict(w, c, Candidate(1, 1, 32, 1, 1, zero_stage=s)).memory["states"] for s in (0, 1, 3)]
    assert z[0] == pytest.approx(16 * w.param_count, rel=1e-9)
    assert z[1] == pytest.approx(4 * w.param_count + 12 * w.param_count / 32, rel=1e-9)
    assert z[2] == pytest.approx(16 * w.param_count / 32, rel=1e-9)


def test_plan_70b_on_1024_gpus_is_fast_and_keeps_tp_in_a_node():
    c = cluster_from_dict({**A100, "nodes": 128})
    t0 = time.perf_counter()
    r = search(from_shape(parse_shape(LLAMA70B)), c, 1024)
    assert time.perf_counter() - t0 < 30
    best = r.ranked[0]
    assert best.candidate.world == 1024 and best.candidate.tp <= 8
    assert best.memory_bytes <= 0.9 * c.memory_bytes and r.fitting < r.considered
    assert all(a.step_s <= b.step_s for a, b in zip(r.ranked, r.ranked[1:]))
    line = why(best, r.ranked[1])
    assert "of the step" in line and ("next-best (" in line or "ties with " in line), line
    assert best.candidate.short() not in line.split(";", 2)[-1]   # names the other layout


def test_no_fitting_layout_is_a_user_error():
    with pytest.raises(UserError, match=r"no layout fits 72 GB per GPU \(usable_memory 0.9 of 80 GB\).*needs"):
        search(from_shape(parse_shape(GPT3)), cluster_from_dict({**A100, "nodes": 1}), 8)
