"""The layout planner's cost model (advisor/step_time.py, advisor/workload.py): the α–β and
shape formulas against hand computations, and the SC'21 validation.
"""

import pytest

from parallelizer.errors import UserError
from parallelizer.advisor.cluster import cluster_from_dict
from parallelizer.advisor.step_time import ring_allreduce, ring_gather
from parallelizer.advisor.workload import eq3_flops, from_shape, parse_shape

A100 = dict(nodes=4, gpus_per_node=8, gpu="a100-80gb", inter_node={"bandwidth_gb_s": 25, "latency_us": 5})
GPT3 = "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"
LLAMA70B = "layers=80,hidden=8192,heads=64,vocab=128256,seq=4096,ffn=28672,kv_heads=8,glu=1"


# --- formulas -------------------------------------------------------------------------------

def test_ring_collectives_follow_alpha_beta():
    link = cluster_from_dict(A100).inter_node
    n = 1e9
    assert ring_allreduce(n, 4, link) == pytest.approx(2 * 3 * 5e-6 + 2 * 3 / 4 * n / 25e9)
    assert ring_gather(n, 4, link) == pytest.approx(3 * 5e-6 + 3 / 4 * n / 25e9)
    assert ring_allreduce(n, 1, link) == 0.0


def test_shape_flops_are_eq3_and_parameters_are_gpt3():
    shape = parse_shape(GPT3)
    w = from_shape(shape)
    assert w.model_flops(1536, recompute=True) == pytest.approx(eq3_flops(shape, 1536), rel=1e-12)
    assert w.param_count == pytest.approx(174.6e9, rel=0.005)    # GPT-3 175B
    assert from_shape(parse_shape(LLAMA70B)).param_count == pytest.approx(70.55e9, rel=0.001)  # untied head


def test_korthikanti_activation_forms():
    shape = parse_shape("layers=2,hidden=1024,heads=16,vocab=1000,seq=512")
    w = from_shape(shape, attention="eager")      # scores materialised: Korthikanti's form
    s, h, a = 512, 1024, 16
    assert w.layer_activation_bytes(1, False) == pytest.approx(s * h * (34 + 5 * a * s / h))
    assert w.layer_activation_bytes(4, False) == pytest.approx(s * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert w.layer_activation_bytes(4, True) == pytest.approx(2 * s * h)
    flash = from_shape(shape)                      # the default: fused attention, no scores
    assert flash.attention == "flash"
    assert flash.layer_activation_bytes(1, False) == pytest.approx(s * h * 34)


@pytest.mark.parametrize("text, words", [
    ("layers=2,hidden=64", ["needs heads, vocab, seq"]),
    ("layers=2,hidden=64,heads=3,vocab=10,seq=8", ["heads (3) must divide hidden (64)"]),
    ("layers=2,width=64", ["'width=64'", "layers, hidden"]),
    ("layers=x,hidden=64,heads=4,vocab=10,seq=8", ["layers must be an integer", "'x'"]),
])
def test_model_shape_errors(text, words):
    with pytest.raises(UserError) as e:
        parse_shape(text)
    for w in words:
        assert w in str(e.value)


# --- the SC'21 validation -------------------------------------------------------------------

def test_sc21_benchmark_meets_its_targets():
    from benchmarks.planner import TABLE, evaluate, read_table
    rows = [evaluate(r) for r in read_table(TABLE)]
    assert len(rows) == 10
    assert sum(r["within_20"] for r in rows) >= 8, [(r["name"], r["error"]) for r in rows]
    assert sum(r["layout_ok"] for r in rows) >= 8, [(r["name"], r["rank"], r["gap"]) for r in rows]
