"""Mixture-of-experts layers found on the captured graph by their algebra
(analysis/experts.py), and the expert-parallel planner's decision and errors
(planning/experts.py): real transformers classes (Mixtral, Qwen2-MoE), no per-model code."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from parallelizer.analysis.experts import find_expert_layers
from parallelizer.compiler import compile_model
from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import load_spec
from parallelizer.planning.experts import plan_ep

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "tests" / "distributed" / "user_models"
SPEC = MODELS / "spec.yaml"


def _module(name: str):
    sys.path.insert(0, str(MODELS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(MODELS))


def _captured(name: str, model=None):
    m = _module(name)
    return capture(model or m.build_model(), m.example_inputs(), MODELS / f"{name}.py").gm.graph


@pytest.mark.parametrize("name, router", [("mixtral_auto", "model.layers.{i}.mlp.gate.weight"),
                                          ("qwen2_moe_ep", "model.layers.{i}.mlp.gate.weight")])
def test_layers_found_with_router_region_and_weights(name, router):
    layers, unsupported = find_expert_layers(_captured(name))
    assert unsupported == []
    assert [l.module for l in layers] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for i, layer in enumerate(layers):
        assert layer.num_experts == 4
        assert layer.weights == (f"model.layers.{i}.mlp.experts.gate_up_proj",
                                 f"model.layers.{i}.mlp.experts.down_proj")
        assert layer.router == router.format(i=i)
        assert len(layer.matmuls) == 2 and len(layer.inputs) == 1 and len(layer.outputs) == 1
        # the region runs from the first grouped matmul to the last: the activation between
        # them is inside, the model's weighting by the router probabilities is not
        assert layer.region[0] == layer.matmuls[0] and layer.region[-1] == layer.matmuls[1]
        assert any("silu" in n for n in layer.region) and not any("mul_2" == n for n in layer.region)


def test_decision_and_report_at_ep2():
    decision = plan_ep(*find_expert_layers(_captured("mixtral_auto")), 2)
    assert decision.ep == 2 and len(decision.layers) == 2
    assert decision.weights == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                for w in ("gate_up_proj", "down_proj")}
    assert decision.report[0].startswith("expert parallel over ep=2 (2 experts per rank): "
                                         "experts of model.layers.0.mlp.experts: 4 x")


def test_ep_not_dividing_the_experts_names_module_and_valid_degrees():
    layers, unsupported = find_expert_layers(_captured("mixtral_auto"))
    with pytest.raises(PlanError, match=r"mesh.ep \(3\) must divide the number of experts \(4\) "
                                        r"of model.layers.0.mlp.experts; valid choices: ep in "
                                        r"\{1, 2, 4\}"):
        plan_ep(layers, unsupported, 3)


def test_per_row_weight_gather_is_an_unsupported_layout_named_by_module():
    m = _module("mixtral_auto").build_model()
    m.config._experts_implementation = "batched_mm"  # W[expert_ids] then bmm: no offsets
    layers, unsupported = find_expert_layers(_captured("mixtral_auto", m))
    assert layers == [] and unsupported
    with pytest.raises(PlanError, match=r"mesh.ep=2: the experts of model.layers.0.mlp.experts "
                                        r"\(model.layers.0.mlp.experts.\w+\) are read by "
                                        r"aten.index.Tensor"):
        plan_ep(layers, unsupported, 2)


def test_ep_on_a_model_without_experts_is_a_compile_error():
    spec = load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2"])
    with pytest.raises(PlanError, match="mesh.ep=2 but the model has no mixture-of-experts layer"):
        compile_model(REPO / "examples" / "llama" / "model.py", spec, weights=False)


def test_ep_must_divide_dp():
    with pytest.raises(Exception, match=r"mesh.ep \(2\) must divide mesh.dp \(1\)"):
        load_spec(SPEC, ["mesh.ep=2"])


def test_compiled_program_holds_one_ep_rank_of_the_experts():
    program = compile_model(MODELS / "mixtral_auto.py", load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2"]),
                            weights=False)
    t = program.plan.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert t.experts is not None and t.experts.ep == 2 and t.role == "experts"
    assert t.shape == (4, 128, 32) and t.rank_shape(1) == (2, 128, 32)
    src = program.sources["program/stage0.py"]
    assert "('mlp.experts.gate_up_proj', (2, 128, 32), 'float32')" in src  # in a block's class
    for op in ("ep_route(", "ep_local_offsets(", "ep_dispatch(", "ep_combine("):
        assert src.count(op) == 1, op  # the two layers' blocks share one emitted class
    assert program.plan.expert_layers[0]["module"] == "model.layers.0.mlp.experts"
    assert "expert parallel over ep=2" in program.report


def test_max_norm_under_ep_is_accepted():
    # runtime/clip.py counts each expert once over ep (tests/distributed/test_expert_parallel_verify.py)
    assert load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2", "optimizer.max_norm=1.0"]).optimizer.max_norm == 1.0


def test_ep_with_tp_is_accepted():
    # refused until ep composed with tp (tests/features/test_expert_tp.py); ep stays carved out of dp
    spec = load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2", "mesh.tp=2"])
    assert (spec.mesh.ep, spec.mesh.tp) == (2, 2)
    with pytest.raises(Exception, match=r"mesh.ep \(2\) must divide mesh.dp \(1\)"):
        load_spec(SPEC, ["mesh.ep=2", "mesh.tp=2"])  # tp does not stand in for dp


def test_ep_inside_pipeline_stages_is_accepted():
    # each stage's ep group splits that stage's experts (tests/distributed/test_expert_parallel_verify.py)
    assert load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2", "mesh.pp=2"]).mesh.pp == 2


class _ThreeDParams(torch.nn.Module):
    """A (1, tokens, dim) position table, a depthwise Conv1d's (dim, 1, 3) weight and a stack
    of (dim, dim) matrices taken out one by one (``W[i]``, the eager expert loop's read)."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 16))
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1, groups=16)
        self.stack = torch.nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x):
        x = x + self.pos
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return sum(x @ self.stack[i] for i in range(4))


def test_only_3d_weights_whose_matrices_are_taken_out_are_expert_weights():
    """A 3-D parameter read by neither a grouped matmul nor a selection along dim 0 is no
    expert weight (a model with a position table or a Conv1d must not be refused at ep > 1
    for it); the per-expert read ``W[i]`` is one, reported by op and source line."""
    model = _ThreeDParams()
    graph = capture(model, (torch.randn(2, 8, 16),), Path(__file__)).gm.graph
    layers, unsupported = find_expert_layers(graph)
    assert layers == [] and {u.weight for u in unsupported} == {"stack"}
    assert unsupported[0].reason.startswith("read by aten.select.int at test_experts.py:")
