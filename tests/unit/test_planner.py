"""The layout planner: cluster-file errors, the α–β and shape formulas against hand
arithmetic, the search's answers and speed, every ``check`` finding, the SC'21 benchmark."""
import time

import pytest

from parallelizer.errors import ClusterError, UserError
from parallelizer.advisor.check import check_spec
from parallelizer.advisor.cluster import GPUS, cluster_from_dict, load_cluster
from parallelizer.advisor.search import search, why
from parallelizer.advisor.step_time import Candidate, predict, ring_allreduce, ring_gather
from parallelizer.advisor.workload import eq3_flops, from_shape, parse_shape
from parallelizer.frontend.spec import Spec

A100 = dict(nodes=4, gpus_per_node=8, gpu="a100-80gb", inter_node={"bandwidth_gb_s": 25, "latency_us": 5})
GPT3 = "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"
LLAMA70B = "layers=80,hidden=8192,heads=64,vocab=128256,seq=4096,ffn=28672,kv_heads=8,glu=1"


# --- cluster file ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"gpu": "v100"}, ["unknown GPU 'v100'", "a100-80gb", "h200"]),
    ({"colour": "red"}, ["unknown key 'colour'"]),
    ({"nodes": 0}, ["nodes must be an integer >= 1", "0"]),
    ({"efficiency": 1.5}, ["efficiency must be null or a number in (0, 1]", "1.5"]),
    ({"inter_node": {"bandwidth_gb_s": -1}}, ["inter_node.bandwidth_gb_s must be a number > 0", "-1"]),
    ({"dtype": "fp8"}, ["dtype must be one of 'bf16', 'fp16', 'fp32'", "fp8"]),
    ({"usable_memory": 0}, ["usable_memory must be a number in (0, 1]", "0"]),
    ({"gpu": {"name": "x", "memory_gb": 10, "memory_bandwidth_gb_s": 1,
              "tflops": {"bf16": 1, "fp16": 1, "fp32": 1}}}, ["intra_node", "needs intra_node"]),
], ids=["unknown-gpu", "unknown-key", "nodes-0", "efficiency", "bandwidth", "dtype", "usable",
     "custom-no-intra"])
def test_cluster_errors_name_key_value_and_fix(change, words):
    with pytest.raises(ClusterError) as e:
        cluster_from_dict({**A100, **change}, "c.yaml")
    for w in words + ["c.yaml"]:
        assert w in str(e.value), (w, str(e.value))


def test_cluster_missing_key_and_file_errors(tmp_path):
    with pytest.raises(ClusterError, match="inter_node is missing"):
        cluster_from_dict({k: v for k, v in A100.items() if k != "inter_node"})
    with pytest.raises(ClusterError, match="does not exist.*specs/clusters"):
        load_cluster(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1\n")
    with pytest.raises(ClusterError, match="not valid YAML at line"):
        load_cluster(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ClusterError, match="must be a YAML mapping, got list"):
        load_cluster(bad)


def test_shipped_cluster_files_load_and_gpu_table_is_dense_datasheet_peak(tools):
    for f in (tools.repo / "specs" / "clusters").glob("*.yaml"):
        assert load_cluster(f).world >= 8
    c = cluster_from_dict({**A100, "gpu": "h100-sxm"})
    assert c.peak_flops == 989.5e12 and c.memory_bytes == 80e9
    assert cluster_from_dict({**A100, "dtype": "fp32"}).peak_flops == 19.5e12
    assert all("datasheet" in g.source for g in GPUS.values())
    # an 8-way group fits a node (NVLink, 300 GB/s); 16 ranks, or 8 ranks 2 apart, do not
    assert c.link(8, 1).bandwidth_gb_s == 450 and c.link(16, 1).bandwidth_gb_s == 25
    assert c.link(8, 2).bandwidth_gb_s == 25


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
    w = from_shape(parse_shape("layers=2,hidden=1024,heads=16,vocab=1000,seq=512"))
    s, h, a = 512, 1024, 16
    assert w.layer_activation_bytes(1, False) == pytest.approx(s * h * (34 + 5 * a * s / h))
    assert w.layer_activation_bytes(4, False) == pytest.approx(s * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert w.layer_activation_bytes(4, True) == pytest.approx(2 * s * h)


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


# --- search ---------------------------------------------------------------------------------

def test_pipeline_bubble_and_memory_follow_the_schedule():
    w = from_shape(parse_shape("layers=16,hidden=4096,heads=32,vocab=51200,seq=2048"))
    c = cluster_from_dict(A100)
    p4 = predict(w, c, Candidate(1, 4, 8, 1, 16))
    t_mb = (p4.terms["compute"] + p4.terms["pp"] + p4.terms["tp"]) / 16
    assert p4.terms["bubble"] == pytest.approx(3 * t_mb)        # (p-1) t_mb: 3 / (16 + 3) of 1F1B
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


# --- check ----------------------------------------------------------------------------------

def _spec(**kw):
    return Spec.model_validate(kw)


@pytest.mark.parametrize("spec, kwargs, severity, words", [
    (dict(mesh=dict(tp=16, dp=2)), {}, "warning", ["mesh.tp", "tp = 16 spans 2 nodes", "25 GB/s", "tp <= 8"]),
    (dict(mesh=dict(pp=4, dp=8), pipeline=dict(microbatches=4)), {}, "warning",
     ["pipeline.microbatches", "bubble of (p-1)/(m+p-1) = 43%", ">= 8"]),
    (dict(mesh=dict(dp=32), zero_stage=3, fsdp=dict(prefetch=dict(forward=0))), {}, "warning",
     ["fsdp.prefetch", "forward = 0", "set it to 1"]),
    (dict(mesh=dict(dp=32)), dict(memory_bytes=90e9, memory_detail="states 80 GB"), "error",
     ["90.0 GB", "states 80 GB", "72.0 GB usable", "0.9 of 80.0 GB", "parallelize plan"]),
    (dict(mesh=dict(dp=16)), {}, "error", ["16 x 1 x 1 = 16", "4 x 8 = 32", "mesh.dp to 32"]),
    (dict(mesh=dict(dp=32)), dict(global_batch=100, micro_batch=2), "error",
     ["--global-batch 100", "32 x 1 x 2 = 64", "multiple of 64"]),
], ids=["tp-across-nodes", "few-microbatches", "zero3-no-prefetch", "memory", "world", "batch"])
def test_every_check_finding(spec, kwargs, severity, words):
    found = check_spec(_spec(**spec), cluster_from_dict(A100), **kwargs)
    assert len(found) == 1, found
    assert found[0].severity == severity
    for w in words:
        assert w in str(found[0]), (w, str(found[0]))


def test_a_good_spec_has_no_findings():
    spec = _spec(mesh=dict(tp=8, pp=2, dp=2), pipeline=dict(microbatches=8))
    assert check_spec(spec, cluster_from_dict(A100), 40e9, "", global_batch=64, micro_batch=4) == []


# --- the SC'21 validation -------------------------------------------------------------------

def test_sc21_benchmark_meets_its_targets():
    from benchmarks.planner import TABLE, evaluate, read_table
    rows = [evaluate(r) for r in read_table(TABLE)]
    assert len(rows) == 10
    assert sum(r["within_20"] for r in rows) >= 8, [(r["name"], r["error"]) for r in rows]
    assert sum(r["layout_ok"] for r in rows) >= 8, [(r["name"], r["rank"], r["gap"]) for r in rows]
