"""The experts' tp split as data (planning/experts.py plan_ep at tp > 1), from the facts
analysis/expert_ffn.py gives (here written by hand: no graph needed)."""
from __future__ import annotations

from parallelizer.analysis.expert_ffn import ExpertFFN
from parallelizer.analysis.experts import ExpertLayer
from parallelizer.plan.layouts import Fused
from parallelizer.planning.experts import ep_summary, plan_ep

GU, DOWN = "m.experts.gate_up_proj", "m.experts.down_proj"


def _layer():
    return ExpertLayer("m.experts", 4, (GU, DOWN), "offs", ("x",), ("mm_1",), ("mm", "mm_1"),
                       ("mm", "chunk", "mm_1"), "m.gate.weight")


def _facts(parts=(64, 64), widths=None, sizes=(), blocker=""):
    return ExpertFFN(column={GU: 1}, row={DOWN: 2}, parts={GU: parts}, sizes=list(sizes),
                     widths=widths or {GU: sum(parts), DOWN: parts[0]}, blocker=blocker)


def test_split_gives_fused_gate_up_row_down_and_local_sizes():
    d = plan_ep([_layer()], [], 1, 2, [_facts(sizes=[("slice_1", 3, None, 64)])])
    assert d.dims == {GU: 1, DOWN: 2} and d.layouts == {GU: Fused((64, 64))}
    assert d.rewrites == {"slice_1": [(3, None, 32)]}
    assert [l["tp"] for l in d.layers] == [True]  # at ep = 1 the pass still rewrites it
    assert ep_summary(d) == "experts: 1 mixture-of-experts layer split over tp=2 along their FFN dim"


def test_ep_and_tp_together_split_both():
    d = plan_ep([_layer()], [], 2, 2, [_facts()])
    assert d.ep == 2 and d.layers[0]["tp"] and d.dims[GU] == 1
    assert ep_summary(d).startswith("expert parallel: 1 mixture-of-experts layer split over ep=2")


def test_a_size_tp_does_not_divide_keeps_the_experts_whole():
    d = plan_ep([_layer()], [], 1, 4, [_facts(parts=(6, 6))])
    assert d.dims == {} and d.layers == [] and ep_summary(d) == ""
    assert ("experts of m.experts kept whole on every tp rank: mesh.tp (4) does not divide the 6 "
            "FFN features of m.experts.down_proj") in d.report


def test_a_blocker_keeps_the_experts_whole_and_ep_still_applies():
    why = "aten.add.Tensor (add) at model.py:12: reads bias [128] across the FFN features"
    d = plan_ep([_layer()], [], 2, 2, [_facts(blocker=why)])
    assert d.dims == {} and [l["tp"] for l in d.layers] == [False]
    assert f"experts of m.experts kept whole on every tp rank: {why}" in d.report


def test_tp_1_plans_no_split():
    d = plan_ep([_layer()], [], 1, 1, None)
    assert d.dims == {} and d.layers == [] and d.tp == 1
