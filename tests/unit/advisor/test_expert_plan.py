"""The planner searches expert parallelism (advisor/search.py, layout_memory.py, stages.py,
step_parts.py): ep only for a model with mixture-of-experts layers, only divisors of dp and
of every layer's experts, at any tp (what the spec accepts: the experts' FFN dim split over
tp); chosen when the experts do not fit otherwise; its memory is ``parallelize estimate``'s
for the compiled layout, ep x tp included; its all-to-alls are the α-β model of the rows each
rank dispatches, its tp all-reduces the f and g around the experts.
"""
from pathlib import Path

import pytest

from parallelizer.advisor.cluster import cluster_from_dict
from parallelizer.advisor.search import candidates, runtime_accepts, search
from parallelizer.advisor.step_time import Candidate, memory_of, predict
from parallelizer.advisor.workload import from_shape, parse_shape
from parallelizer.errors import UserError

A100 = dict(nodes=1, gpus_per_node=8, gpu="a100-80gb")
# two blocks of 64 experts (h 4096, expert ffn 18432, gated): 14.5 B expert parameters per block
BIG_MOE = ("layers=2,hidden=4096,heads=32,kv_heads=8,vocab=32000,seq=256,glu=1,"
           "experts=64,topk=2,moe_ffn=18432")
SMALL_MOE = "layers=2,hidden=256,heads=4,vocab=512,seq=64,glu=1,experts=6,topk=2,moe_ffn=512"


def test_ep_only_divides_dp_and_the_experts_and_only_for_moe():
    c = cluster_from_dict(A100)
    moe = list(candidates(from_shape(parse_shape(SMALL_MOE)), c, 8))
    eps = {(lay.dp, lay.ep) for lay in moe}
    assert {e for _, e in eps} == {1, 2}          # 6 experts: 4 and 8 divide dp, not E
    assert all(lay.dp % lay.ep == 0 and 6 % lay.ep == 0 for lay in moe)
    assert any(lay.tp > 1 for lay in moe if lay.ep > 1)   # the spec accepts ep with tp > 1
    assert {(lay.tp, lay.dp, lay.ep) for lay in moe} >= {(2, 4, 2), (4, 2, 2), (2, 2, 2)}
    assert (8, 2) in eps and (1, 1) in eps
    dense = list(candidates(from_shape(parse_shape("layers=2,hidden=256,heads=4,vocab=512,seq=64")), c, 8))
    assert dense and all(lay.ep == 1 for lay in dense)
    assert all(runtime_accepts(t, e, p, z) for t in (1, 2, 4) for e in (1, 2) for p in (1, 2)
               for z in (0, 1, 2, 3))


def test_search_proposes_ep_when_the_experts_do_not_fit_replicated():
    """29 B expert parameters: sharded 8 ways they take 58 GB of states (16 bytes each), and at
    ep 1 FSDP2 gathers a whole block's 64 experts on top (29 GB in bf16; 2 of them under
    ZeRO-3's prefetch, all under ZeRO-2), so nothing fits 72 GB, at pp 2 neither (4 ranks
    share a block's states, 58 GB, and gather it, 29 GB). At ep = dp a rank holds its experts
    outside FSDP2 (the same 58 GB) and gathers the dense weights only. (Without ``tp=1``
    tp splits the experts' FFN dim too: tp 8 fits without ep, as the last test shows.)"""
    w = from_shape(parse_shape(BIG_MOE))
    c = cluster_from_dict(A100)
    options = dict(zero_stages=(2, 3), accumulate=False)
    r = search(w, c, 8, fix={"tp": 1}, **options)
    assert r.ranked[0].candidate.ep > 1
    assert all(p.candidate.ep > 1 for p in r.ranked)
    with pytest.raises(UserError, match="no layout fits"):
        search(w, c, 8, fix={"tp": 1, "ep": 1}, **options)
    best = r.ranked[0]
    assert best.memory["all-to-all"] > 0 and best.terms["ep"] > 0
    assert "ep=" in best.candidate.short()


def _ep_rows(pred):
    return [c for c in pred.breakdown["collectives"] if c["dim"] == "ep"]


@pytest.mark.parametrize("measured", [False, True])
def test_alltoall_term_is_bytes_over_bandwidth_plus_latency(measured):
    """dp4 x ep2 at b = 2 sequences of 64 tokens, top-2, hidden 256, bf16: each dispatch and
    combine moves b s k h x 2 bytes per rank, (g-1)/g of it off the rank; 4 per layer per
    microbatch (dispatch, combine, and their backward), plus the router's counts."""
    spec = dict(A100, nodes=1, gpus_per_node=4)
    if measured:
        spec["measured"] = {"date": "2026-12-02", "device": "test", "backend": "nccl", "ranks": 4,
                            "collectives": {"intra_node": {"all_to_all": {2: {"latency_us": 40.0,
                                                                               "bandwidth_gb_s": 7.0}}}}}
    c = cluster_from_dict(spec)
    w = from_shape(parse_shape(SMALL_MOE))
    pred = predict(w, c, Candidate(1, 1, 4, 2, 1, zero_stage=3, ep=2))
    n = 2 * 64 * 2 * 256 * 2
    if measured:
        want = 40e-6 + 0.5 * n / 7e9
    else:
        link = c.link(2, 1)
        want = link.latency_us * 1e-6 + 0.5 * n / (link.bandwidth_gb_s * 1e9)
    (row,) = _ep_rows(pred)
    assert row["op"] == "all-to-all" and row["group"] == 2 and row["bytes_per_call"] == n
    assert row["calls"] == 4 * 2 and row["seconds_per_call"] == pytest.approx(want, rel=1e-12)
    assert row["source"] == ("measured" if measured else "cluster links")
    counts = [x for x in pred.breakdown["collectives"] if x["dim"] == "ep (counts)"]
    assert pred.terms["ep"] == pytest.approx(row["total_s"] + counts[0]["total_s"], rel=1e-12)
    assert sum(pred.terms.values()) == pytest.approx(pred.step_s, rel=1e-9)
    # the experts' gradients over edp (dp / ep = 2), fp32, E/ep experts per layer
    expert = 3 * 256 * 512
    (edp,) = [x for x in pred.breakdown["collectives"] if x["dim"] == "edp"]
    assert edp["op"] == "all-reduce" and edp["group"] == 2
    assert edp["bytes_per_call"] == 2 * 6 * expert / 2 * 4
    # dp no longer reduces them: its reduce-scatters carry the dense weights only
    ep1 = predict(w, c, Candidate(1, 1, 4, 2, 1, zero_stage=3))
    rs = lambda p: sum(x["bytes_per_call"] * x["calls"] for x in p.breakdown["collectives"]
                       if x["op"] == "reduce-scatter")
    assert rs(ep1) - rs(pred) == pytest.approx(2 * 6 * expert * 2, rel=1e-9)   # bf16, all experts
    assert not _ep_rows(ep1) and ep1.terms["ep"] == 0
    from parallelizer.advisor.explain import explain
    text = explain(pred)
    assert "expert-parallel all-to-alls" in text and "ep           all-to-all      group 2    8 x" in text
    assert "edp          all-reduce" in text and "dp=4 ep=2 zero=3" in text


MODELS = Path(__file__).resolve().parents[2] / "distributed" / "user_models"


@pytest.fixture(scope="module")
def mixtral():
    from parallelizer.advisor.capture import capture_workload
    return capture_workload(MODELS / "mixtral_train.py", None)


@pytest.mark.parametrize("zero, tp, ep", [(0, 1, 2), (3, 1, 2), (3, 2, 2), (0, 2, 2), (3, 2, 1),
                                          (0, 2, 1)])
def test_memory_equals_estimate_for_the_compiled_layout(mixtral, zero, tp, ep):
    """mixtral_train.py (2 layers of 4 experts, fp32, AdamW) at dp2 x ep2, dp2 x ep2 x tp2
    and dp2 x tp2: the planner's states, FSDP2 gathers and all-to-all buffers are what
    ``parallelize estimate`` counts for the layout it writes (estimate adds AdamW's 4-byte
    ``step`` per tensor and the buffers; the activations are Korthikanti's formula, not
    compared). At tp2 the experts' FFN dim is split: 1/(ep x tp) of them per rank."""
    from parallelizer.advisor.layout_spec import layout_spec
    from parallelizer.advisor.memory import STEP_BYTES, estimate_model_file
    from parallelizer.frontend.spec import Spec, load_spec
    w = mixtral
    assert [(l.experts, l.top_k, l.params, l.row_elems) for l in w.moe] == [(4, 2.0, 24576.0, 32.0)] * 2
    c = cluster_from_dict({"nodes": 1, "gpus_per_node": 2 * tp, "dtype": "fp32", "gpu": {
        "name": "cpu", "memory_gb": 4, "memory_bandwidth_gb_s": 10,
        "tflops": {"bf16": 0.05, "fp16": 0.05, "fp32": 0.1}}, "intra_node": {"bandwidth_gb_s": 5, "latency_us": 20}})
    assert all(l.tp_split(2) for l in w.moe)
    lay = Candidate(tp, 1, 2, 4, 1, zero_stage=zero, ep=ep)      # the example's 8 rows over dp 2
    mem, parts = memory_of(w, c, lay)
    spec = Spec.model_validate(layout_spec(load_spec(MODELS / "spec.yaml", ["optimizer.name=adamw"]), lay, c))
    assert (spec.mesh.ep, spec.mesh.tp) == (ep, tp)
    plan, ranks = estimate_model_file(MODELS / "mixtral_train.py", spec)
    assert plan.ep == ep and len(ranks) == 2 * tp
    # the planner divides every dense block parameter by tp (Megatron's approximation);
    # the run keeps the norms and the router whole on every tp rank: 2 layers x (2 norms of
    # 32 + the router's 4 x 32) + the final norm's 32 = 416 elements, of which the planner
    # misses (1 - 1/tp), 16 bytes each at ZeRO-0, over the dp shards at ZeRO-3
    whole = 416 * (1 - 1 / tp) * 16 / (2 if zero == 3 else 1)
    for r in ranks:
        states = r.parameters + r.gradients + r.optimizer - STEP_BYTES * sum(w.tensors)
        assert parts["states"] + whole == pytest.approx(states, rel=1e-12)
        gap = 416 * (1 - 1 / tp) * 4 if zero == 3 else 0.0   # the same, all-gathered in fp32
        assert parts["gathered"] + gap == pytest.approx(r.gathered_parameters, rel=1e-12)
        if ep > 1:
            assert parts["all-to-all"] == r.alltoall_buffers == 3 * 4 * 8 * 2 * 32 * 4
    if (zero, tp, ep) == (3, 2, 2):   # docs/expert-parallel.md's figures
        assert {r.parameters for r in ranks} == {60_224}
        experts = sum(l.params for l in w.moe) * 4
        assert experts == 196_608 and experts / (ep * tp) == 49_152


def test_captured_experts_take_the_tp_split_the_compiler_makes(mixtral):
    """mixtral_train.py's layers: analysis/expert_ffn.py finds no blocker (gate | up 128 = two
    parts of 64, down 64), so tp 2 splits them and tp 3 does not; at dp2 x ep2 x tp2 each
    layer all-reduces its 4 x 8 x 2 rows x 32 x 4 bytes over tp in forward and in backward,
    and its grouped matmuls run half the FLOPs."""
    w = mixtral
    assert [(l.tp_sizes, l.tp_blocker) for l in w.moe] == [((128, 64, 64, 64), "")] * 2
    assert all(l.tp_split(2) and not l.tp_split(3) for l in w.moe)
    c = cluster_from_dict({"nodes": 1, "gpus_per_node": 4, "dtype": "fp32", "gpu": {
        "name": "cpu", "memory_gb": 4, "memory_bandwidth_gb_s": 10,
        "tflops": {"bf16": 0.05, "fp16": 0.05, "fp32": 0.1}}, "intra_node": {"bandwidth_gb_s": 5, "latency_us": 20}})
    p = predict(w, c, Candidate(2, 1, 2, 4, 1, zero_stage=3, ep=2))
    ars = [(x["bytes_per_call"], x["calls"]) for x in p.breakdown["collectives"]
           if x["dim"] == "tp" and x["op"] == "all-reduce"]
    assert (4 * 8 * 2 * 32 * 4, 2 * 2) in ars
    grouped = [k for _, _, k in w.source.units(4)[1].fwd if k.experts]
    assert len(grouped) == 2 and all(k.sharded("seq", 0, 2, False).flops == k.flops / 2 for k in grouped)


@pytest.mark.parametrize("text, words", [
    ("layers=2,hidden=64,heads=4,vocab=128,seq=16,topk=2", "topk needs experts=E"),
    ("layers=2,hidden=64,heads=4,vocab=128,seq=16,moe_ffn=128", "moe_ffn needs experts=E"),
    ("layers=2,hidden=64,heads=4,vocab=128,seq=16,experts=4,topk=5", "topk (5) must be <= experts (4)"),
])
def test_model_shape_moe_errors(text, words):
    with pytest.raises(UserError, match=__import__("re").escape(words)):
        parse_shape(text)


def test_model_shape_moe_counts_experts_and_the_tokens_flops():
    """A Mixtral-like shape: E experts' parameters, but a token's FLOPs are the router's and
    k experts'; without the MoE keys the shape is the dense one it was."""
    base = "layers=2,hidden=64,heads=4,vocab=128,seq=16,glu=1,ffn=256"
    dense, moe = from_shape(parse_shape(base)), from_shape(parse_shape(base + ",experts=8,topk=2"))
    expert = 3 * 64 * 256
    assert moe.params[1] - dense.params[1] == 7 * expert + 64 * 8
    assert moe.fwd_flops[1] - dense.fwd_flops[1] == 2 * 16 * (expert + 64 * 8)
    assert moe.expert_params == (0.0, 8 * expert, 8 * expert, 0.0) and not dense.moe
    assert dense.ep_choices(8) == [1] and moe.ep_choices(8) == [1, 2, 4, 8]


def test_ep_with_tp_splits_the_experts_ffn_and_pays_their_f_and_g():
    """dp2 x ep2 x tp2, b = 2 sequences of 64 tokens, top-2, hidden 256, bf16, sequence
    parallel: each MoE layer all-reduces b s k h x 2 bytes over tp once in forward (g, on the
    experts' output) and once in backward (f, on the rows entering them), all-reduces under sp
    too; each tp rank's all-to-alls move the same bytes as at tp 1 (it dispatches all its rows
    over its own ep group); a grouped matmul runs on F / tp features."""
    from parallelizer.advisor.kernels import grouped_mm
    c = cluster_from_dict(dict(A100, nodes=1, gpus_per_node=4))
    w = from_shape(parse_shape(SMALL_MOE))
    n = 2 * 64 * 2 * 256 * 2
    at = {t: predict(w, cluster_from_dict(dict(A100, nodes=1, gpus_per_node=2 * t)),
                     Candidate(t, 1, 2, 2, 1, zero_stage=3, ep=2)) for t in (1, 2)}
    ars = [x for x in at[2].breakdown["collectives"] if x["dim"] == "tp" and x["op"] == "all-reduce"
           and x["bytes_per_call"] != 4.0 * 2 * 64]   # not the vocab-parallel loss's three
    assert [(x["bytes_per_call"], x["calls"], x["group"]) for x in ars] == [(n, 2 * 2, 2)]   # 2 layers
    assert [(x["bytes_per_call"], x["calls"]) for x in _ep_rows(at[2])] == \
        [(x["bytes_per_call"], x["calls"]) for x in _ep_rows(at[1])] == [(n, 8)]
    f, (dgrad, wgrad) = grouped_mm(6, 256, 1024, 256, 1024, (512,))
    for k in (f, dgrad, wgrad):
        half = k.sharded("seq", 0, 2, False)
        assert half.flops == k.flops / 2 and sorted(half.dims) == sorted(k.dims[:1] + tuple(
            d / 2 if d == 1024 else d for d in k.dims[1:]))
    # tp 3 does not divide F = 512: kept whole on every tp rank, no f / g
    f, _ = grouped_mm(6, 256, 1024, 256, 1024, (512,))
    assert f.sharded("seq", 0, 3, False) is f
    layer = w.moe[0]
    assert layer.tp_split(2) and layer.tp_split(4) and not layer.tp_split(3)
    assert w.expert_shard(2)[1] == w.expert_params[1] / 2 and w.expert_shard(3) == w.expert_params
    _, parts = memory_of(w, c, Candidate(2, 1, 2, 2, 1, zero_stage=0, ep=2))
    _, whole = memory_of(w, c, Candidate(1, 1, 2, 2, 1, zero_stage=0, ep=2))
    assert parts["all-to-all"] == whole["all-to-all"] > 0


def test_search_proposes_ep_with_tp():
    """BIG_MOE at tp 2 (fixed): ep > 1 layouts are searched and ranked with it (each rank
    holds 1/(ep x tp) of the experts); tp 8 alone now fits too (the experts 1/8 per rank)."""
    w = from_shape(parse_shape(BIG_MOE))
    c = cluster_from_dict(A100)
    options = dict(zero_stages=(2, 3), accumulate=False)
    r = search(w, c, 8, fix={"tp": 2}, **options)
    assert any(p.candidate.ep > 1 for p in r.ranked)
    assert all(p.candidate.tp == 2 for p in r.ranked)
    both = search(w, c, 8, fix={"tp": 2, "ep": 4}, **options).ranked[0]
    assert "tp=2" in both.candidate.short() and "ep=4" in both.candidate.short()
    assert both.memory["all-to-all"] > 0 and both.terms["ep"] > 0
    free = search(w, c, 8, **options)
    assert any(p.candidate.ep > 1 and p.candidate.tp > 1 for p in free.ranked)
    assert any(p.candidate.tp == 8 and p.candidate.ep == 1 for p in free.ranked)
