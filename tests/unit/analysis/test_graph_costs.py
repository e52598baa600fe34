"""Pipeline cost model (analysis/graph_costs.py) against FLOPs worked out by hand, the spec
overrides of the split, microbatch validation and the bubble formulas.

The model: an input projection (Linear 12 -> 16, no bias), then 3 blocks of
[Linear 16 -> 48 (q, k, v), SDPA over 2 heads of 8, Linear 16 -> 16], then a head
(Linear 16 -> 10). A matmul [M, K] x [K, N] is 2*M*K*N FLOPs; its backward computes the
input's gradient (same FLOPs) when the input requires grad and the weight's gradient (same
FLOPs) always. SDPA forward is 2 bmms (q k^T, p v), backward 5 (torch.utils.flop_counter's
sdpa_backward_flop_count).
"""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError, SpecError
from parallelizer.frontend.capture import capture
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.analysis.graph_costs import collect_costs
from parallelizer.planning.pipeline import find_blocks, plan_from_costs, plan_pipeline
from parallelizer.planning.pipeline_summary import bubble, check_microbatches, summarize
from parallelizer.frontend.spec import load_spec

B, S, D, H, IN, OUT = 2, 6, 16, 2, 12, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], D))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, D, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, OUT, bias=False)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def mm(m, k, n):
    return 2 * m * k * n


@pytest.fixture(scope="module")
def costs():
    torch.manual_seed(0)
    model = Tiny()
    gm = capture(model, (torch.randn(B, S, IN),), Path(__file__)).gm
    apply_cleanup(gm)
    return collect_costs(gm, find_blocks(model), {})


def test_flops_match_hand_computed(costs):
    tokens = B * S
    attn = 2 * mm(B * H * S, D // H, S)                              # q k^T and p v
    block_fwd = mm(tokens, D, 3 * D) + attn + mm(tokens, D, D)
    block_bwd = 2 * mm(tokens, D, 3 * D) + 5 * mm(B * H * S, D // H, S) + 2 * mm(tokens, D, D)
    pre, *blocks, post = costs.units
    assert [u.name for u in costs.units] == ["<before blocks.0>", "blocks.0", "blocks.1", "blocks.2",
                                             "<after blocks.2>"]
    # the input x needs no gradient: the first linear's backward is its weight gradient only
    assert (pre.fwd_flops, pre.bwd_flops) == (mm(tokens, IN, D), mm(tokens, IN, D))
    assert all((b.fwd_flops, b.bwd_flops) == (block_fwd, block_bwd) for b in blocks)
    assert (post.fwd_flops, post.bwd_flops) == (mm(tokens, D, OUT), 2 * mm(tokens, D, OUT))
    assert costs.notes == () and costs.batch_shape == (B, S, IN)


def test_parameter_and_activation_bytes(costs):
    assert costs.units[0].params == ("inp.weight",)
    assert costs.units[1].params == ("blocks.0.qkv.weight", "blocks.0.proj.weight")
    assert costs.units[-1].params == ("head.weight",)
    assert costs.param_bytes["blocks.0.qkv.weight"] == 3 * D * D * 4
    assert costs.cut_bytes == (B * S * D * 4,) * 4        # one fp32 hidden state per cut


def test_summary_per_stage(costs):
    d = plan_from_costs(costs, 2, ("blocks.0", "blocks.1", "blocks.2"))
    s = summarize(d, costs, "1f1b", 2, 4)
    flops = [u.flops for u in costs.units]
    assert [st["flops"] for st in s["stages"]] == list(d.stage_costs)
    assert sum(st["flops"] for st in s["stages"]) == sum(flops)
    assert s["imbalance"] == max(d.stage_costs) / (sum(flops) / 2)
    assert s["stages"][0]["activation_bytes_sent"] == B * S * D * 4
    assert s["stages"][1]["activation_bytes_sent"] == 0
    # the balanced split cuts blocks.1 after its attention (q, k, v + SDPA go with qkv, the
    # block's own nodes with the most recent child): only the hidden state crosses there
    assert dict(d.part_stages) == {"blocks.1.qkv": 0, "blocks.1.proj": 1}
    assert s["stages"][0]["children"] == {"blocks.1": ["blocks.1.qkv"]}
    assert costs.part_cut_bytes == ((B * S * D * 4,),) * 3
    assert {f for st in s["stages"] for f in st["fqns"]} == set(costs.param_bytes)
    assert s["bubble"] == pytest.approx(1 / 5)


def test_bubble_formulas():
    assert bubble("1f1b", 4, 8) == 3 / 11 and bubble("gpipe", 4, 8) == 3 / 11
    assert bubble("interleaved_1f1b", 4, 8, 2) == 3 / 19   # (P-1)/(v*M+P-1)
    assert bubble("1f1b", 4, 8, 2) == 3 / 11               # v applies to interleaved only


# --- overrides ---------------------------------------------------------------------------------

BLOCKS = tuple(f"model.layers.{i}" for i in range(6))


def plan(**kw):
    return plan_pipeline([1] * 6, 0, 0, 3, BLOCKS, **kw)


def test_split_points_override():
    d = plan(split_points=["model.layers.1", "model.layers.5"])
    assert d.stage_of_block == (0, 1, 1, 1, 1, 2) and d.source == "pipeline.split_points"


def test_layers_per_stage_override():
    d = plan(layers_per_stage=[1, 2, 3])
    assert d.stage_of_block == (0, 1, 1, 2, 2, 2) and d.stage_costs == (1, 2, 3)
    assert plan(layers_per_stage=[3, 3, 0]).stage_of_block == (0, 0, 0, 1, 1, 1)


@pytest.mark.parametrize("kw, message", [
    (dict(split_points=["model.layer.3", "model.layers.5"]),
     "pipeline.split_points: 'model.layer.3' is not a block of the model; did you mean "
     "model.layers.3"),
    (dict(split_points=["model.layers.3"]),
     "pipeline.split_points has 1 entries ['model.layers.3'], but 3 stages (mesh.pp=3) need 2"),
    (dict(split_points=["model.layers.0", "model.layers.3"]),
     "pipeline.split_points: 'model.layers.0' is the first block, so stage 0 would hold no block"),
    (dict(split_points=["model.layers.4", "model.layers.2"]),
     "pipeline.split_points must be distinct blocks in execution order, got "
     "['model.layers.4', 'model.layers.2']"),
    (dict(layers_per_stage=[2, 4]),
     "pipeline.layers_per_stage has 2 entries [2, 4], but there are 3 stages (mesh.pp=3)"),
    (dict(layers_per_stage=[2, 2, 3]),
     "pipeline.layers_per_stage [2, 2, 3] sums to 7, but the model has 6 blocks; make the "
     "entries sum to 6"),
    (dict(layers_per_stage=[3, 0, 3]),
     "pipeline.layers_per_stage [3, 0, 3]: every stage needs at least one block, except the last"),
])
def test_bad_override_is_a_plan_error(kw, message):
    with pytest.raises(PlanError) as e:
        plan(**kw)
    assert str(e.value).startswith(message), str(e.value)


def test_override_names_the_stage_count_key():
    with pytest.raises(PlanError, match=r"but there are 4 stages \(mesh.pp x pipeline.virtual_stages=4\)"):
        plan_pipeline([1] * 6, 0, 0, 4, BLOCKS, layers_per_stage=[6],
                      stages_key="mesh.pp x pipeline.virtual_stages")


def test_spec_refuses_both_overrides_and_bad_types(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("mesh: {pp: 2}\npipeline: {microbatches: 4}\n")
    with pytest.raises(SpecError) as e:
        load_spec(path, ["pipeline.split_points=[model.layers.2]", "pipeline.layers_per_stage=[2,2]"])
    assert "set pipeline.split_points or pipeline.layers_per_stage, not both" in str(e.value)
    with pytest.raises(SpecError) as e:
        load_spec(path, ["pipeline.layers_per_stage=[2,-1]"])
    assert "pipeline.layers_per_stage.1 must be null or a list of block counts per stage" in str(e.value)
    assert "got -1" in str(e.value)
    spec = load_spec(path, ["pipeline.split_points=[model.layers.2]"])
    assert spec.pipeline.split_points == ["model.layers.2"]


# --- microbatches against pp ---------------------------------------------------------------------

def test_fewer_microbatches_than_stages_is_an_error():
    with pytest.raises(PlanError) as e:
        check_microbatches(4, 3, "gpipe")
    assert str(e.value) == ("pipeline.microbatches (3) must be >= mesh.pp (4): with fewer "
                            "microbatches than stages some stage never has work; set "
                            "pipeline.microbatches=4 or more (>= 8 keeps the bubble under 33%)")


def test_fewer_than_twice_the_stages_warns_with_the_bubble():
    assert check_microbatches(4, 5, "1f1b") == [
        "pipeline.microbatches (5) < 2 x mesh.pp = 8: the pipeline bubble is 38% of the step "
        "(1f1b); more microbatches shrink it (8 gives 27%)"]
    assert check_microbatches(4, 8, "1f1b") == [] and check_microbatches(1, 1, "1f1b") == []


def test_virtual_stages_read_defensively():
    from parallelizer.planning.pipeline_summary import virtual_stages_of

    assert virtual_stages_of(SimpleNamespace()) == 1
    assert virtual_stages_of(SimpleNamespace(virtual_stages=3)) == 3


def test_report_section_shows_costs_warnings_and_pictures(costs):
    from parallelizer.emit.report import pipeline_section

    d = plan_from_costs(costs, 2, ("blocks.0", "blocks.1", "blocks.2"),
                        SimpleNamespace(split_points=None, layers_per_stage=[2, 1]))
    s = summarize(d, costs, "gpipe", 2, 3)
    assert d.stage_of_block == (0, 0, 1)
    plan = SimpleNamespace(stages=[SimpleNamespace(index=0, blocks=("blocks.0", "blocks.1"), outputs=["proj"]),
                                   SimpleNamespace(index=1, blocks=("blocks.2",), outputs=[])])
    warning = check_microbatches(2, 3, "gpipe")
    text = "\n".join(pipeline_section(plan, s, warning))
    assert "theoretical bubble: 25.0% = (P-1)/(M+P-1) with P=2, M=3 (gpipe)" in text
    assert f"imbalance {s['imbalance']:.3f}" in text
    assert "| 0 | blocks.0 .. blocks.1 |" in text and "| 1 | blocks.2 |" in text
    assert "- warning: pipeline.microbatches (3) < 2 x mesh.pp = 4: the pipeline bubble is 25%" in text
    assert "![stage cost](pipeline_costs.png)" in text and "![schedule](pipeline_schedule.png)" in text
