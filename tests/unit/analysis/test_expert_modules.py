"""Per-module experts (a ``nn.ModuleList`` of expert MLPs and a loop over them) found on the
graph (analysis/expert_modules.py) and stacked into one grouped computation
(passes/stack_experts.py): model code from outside transformers (Mistral's and DeepSeek-V3's
reference MoE layers, tests/distributed/user_models), captured for real."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer.analysis.expert_modules import find_module_experts
from parallelizer.analysis.experts import find_expert_layers
from parallelizer.compiler import compile_model, compile_module
from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import load_spec
from parallelizer.passes.stack_experts import apply_stack_experts

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
    return capture(model or m.build_model(), m.example_inputs(), MODELS / f"{name}.py")


@pytest.mark.parametrize("name, lists", [
    ("mistral_moe_reference", ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]),
    ("deepseek_v3_reference", ["layers.1.ffn.experts", "layers.2.ffn.experts"])])
def test_expert_lists_are_found_and_nothing_else(name, lists):
    """The experts of every MoE layer; not the list of transformer blocks (each reads the one
    before), not the dense FFN or the shared expert (one module, no list)."""
    layers, unsupported = find_module_experts(_captured(name).gm.graph)
    assert unsupported == []
    assert [l.module for l in layers] == lists
    for l in layers:
        assert l.num_experts == 4 and l.slots == ("w1.weight", "w3.weight", "w2.weight")
        assert l.weights[3] == tuple(f"{l.module}.3.{s}" for s in l.slots)
        assert [len(r) for r in l.regions] == [5] * 4  # w1, silu, w3, mul, w2
        assert all(len(i) == 1 and len(o) == 1 for i, o in zip(l.inputs, l.outputs))


@pytest.mark.parametrize("name", ["mistral_moe_reference", "deepseek_v3_reference"])
def test_stacked_graph_computes_what_the_loop_computes_bit_for_bit(name):
    """Outputs and gradients of the rewritten graph equal the unmodified model's to 1e-6
    relative: each expert's segment is the same mm as its F.linear, but the activation
    (silu) now runs vectorised over every expert's rows at once, whose SIMD tails fall
    elsewhere (last-bit differences), and the tokens' gradient sums its experts'
    contributions in another order. The stacked weights' gradients are the experts' own,
    stacked, and the stacked layer is what analysis/experts.py finds."""
    m = _module(name)
    model = m.build_model()
    captured = _captured(name, model)
    layers, _ = find_module_experts(captured.gm.graph)
    stacked: dict = {}
    assert apply_stack_experts(captured.gm, layers, stacked)
    assert len(stacked) == 3 * len(layers)
    found, unsupported = find_expert_layers(captured.gm.graph)
    assert unsupported == [] and [l.module for l in found] == [l.module for l in layers]
    assert all(l.router.endswith("gate.weight") for l in found)
    batch = m.example_inputs()
    want = model(*batch)
    m.loss_fn(want, batch).backward()
    got = captured.gm(*batch)[0]
    m.loss_fn(got, batch).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    grads = dict(captured.gm.named_parameters())
    for fqn, members in stacked.items():
        expected = torch.stack([model.get_parameter(e).grad for e in members])
        torch.testing.assert_close(grads[fqn].grad, expected, rtol=1e-6, atol=1e-9, msg=fqn)
    for fqn, p in model.named_parameters():
        if fqn in grads:
            torch.testing.assert_close(grads[fqn].grad, p.grad, rtol=1e-6, atol=1e-9, msg=fqn)
    members = {e for ms in stacked.values() for e in ms}
    assert members.isdisjoint(grads)
    assert (set(grads) - set(stacked)) | members == set(dict(model.named_parameters()))


def _with_expert(model, index: int, expert: nn.Module):
    model.layers[0].feed_forward.experts[index] = expert
    return model


class _GeluExpert(nn.Module):
    def __init__(self, like):
        super().__init__()
        self.w1, self.w2, self.w3 = like.w1, like.w2, like.w3

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize("change, reason", [
    (lambda e: setattr(e, "w1", nn.Linear(e.w1.in_features, e.w1.out_features, bias=True)) or e,
     r"layers.0.feed_forward.experts.1: layers.0.feed_forward.experts.1.w1.weight is read by "
     r"aten.linear.default \(mistral_moe_reference.py:\d+\), not by a bias-free F.linear"),
    (_GeluExpert, r"expert 1 of layers.0.feed_forward.experts does not compute what expert 0 computes")])
def test_expert_list_that_cannot_be_stacked_is_refused_at_ep2_naming_it(change, reason):
    m = _module("mistral_moe_reference")
    model = m.build_model()
    _with_expert(model, 1, change(model.layers[0].feed_forward.experts[1]))
    _, unsupported = find_module_experts(_captured("mistral_moe_reference", model).gm.graph)
    assert [u.module for u in unsupported] == ["layers.0.feed_forward.experts"]
    spec = load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2"])
    with pytest.raises(PlanError, match=r"mesh.ep=2: the experts of layers.0.feed_forward.experts "
                                        r"\(layers.0.feed_forward.experts.0.w1.weight\) are a list "
                                        r"of expert modules that cannot be stacked into one grouped "
                                        r"computation: " + reason + r".*Fix: make the experts "
                                        r"bias-free F.linear layers"):
        compile_module(model, m.example_inputs(), spec, m.loss_fn, reference=False)


def test_ep1_keeps_the_expert_modules_as_they_are():
    """Stacking runs only for expert parallelism: at ep = 1 each expert keeps its own names
    (tensor parallelism splits each expert's linears as a dense MLP's)."""
    program = compile_model(MODELS / "mistral_moe_reference.py", load_spec(SPEC, ["mesh.tp=2"]),
                            weights=False)
    names = set(program.plan.tensors)
    assert "layers.0.feed_forward.experts.3.w2.weight" in names
    assert "layers.0.feed_forward.experts.w2.weight" not in names
    assert program.plan.tensors["layers.0.feed_forward.experts.3.w2.weight"].role == "row_parallel"


def test_tp_that_splits_only_the_experts_compiles_and_says_so(capsys):
    """switch_conv.py: a depthwise-conv token mixer (no sharded rule; its 3-D Conv1d weight is
    no stacked expert weight) and top-1 per-module experts. At dp2 x ep2 x tp2 the experts split over ep and
    along their FFN dim over tp, so tp shards something: a warning names the op that kept
    attention replicated instead of the "no weight matrix could be sharded" refusal, and the
    summary counts the split experts."""
    program = compile_model(MODELS / "switch_conv.py",
                            load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2", "mesh.tp=2"]), weights=False)
    wi = program.plan.tensors["blocks.0.moe.experts.wi.weight"]
    assert wi.shape == (4, 64, 32) and wi.rank_shape(2) == (2, 32, 32)
    assert program.plan.tensors["blocks.0.moe.router.weight"].role == "replicate"
    assert "mesh.tp=2 splits only the experts (along their FFN dim): no other weight matrix " \
           "could be sharded (no column/row pair was found: each linear's output meets a " \
           "residual add" in "\n".join(program.warnings), program.warnings
    # the depthwise convolutions' 3-D kernels are weight matrices kept whole: counted (16 of
    # 18 before they were) and each named with the op that reads it
    assert any(n.startswith("tensor parallel: 16 of 20 weight matrices in blocks sharded")
               for n in program.notes), program.notes
    report = "\n".join(program.plan.tp_report)
    for i in range(2):
        assert f"replicated: blocks.{i}.mix.weight (32x1x" in report, report


def _rows_3d(self, inputs):
    weights, selected = torch.topk(self.gate(inputs), 2)
    weights, results = F.softmax(weights, dim=1), torch.zeros_like(inputs)
    for i, expert in enumerate(self.experts):
        batch_idx, nth = torch.where(selected == i)
        results[batch_idx] += weights[batch_idx, nth, None] * expert(inputs[None, batch_idx])[0]
    return results


def _dropout_inside(self, x):
    return self.w2(F.dropout(F.silu(self.w1(x)) * self.w3(x), 0.1, self.training))


def _patched(layer_forward=None, expert_forward=None):
    m = _module("mistral_moe_reference")
    model = m.build_model()
    for block in model.layers:
        moe = block.feed_forward
        if layer_forward:
            moe.forward = layer_forward.__get__(moe)
        for e in moe.experts if expert_forward else ():
            e.forward = expert_forward.__get__(e)
    return model


@pytest.mark.parametrize("layer, expert, reason, fix", [
    (_rows_3d, None, r"layers.0.feed_forward.experts.0: layers.0.feed_forward.experts.0.w1.weight's "
     r"linear \(mistral_moe_reference.py:\d+\) runs on rows of shape \(1, u\d+, 32\); experts are "
     r"stacked on 2-D rows", r"call each expert on its \(tokens, dim\) rows"),
    (None, _dropout_inside, r"layers.0.feed_forward.experts.0: aten.dropout.default "
     r"\(\w+.py:\d+\) between its linears is not an op that computes each row",
     r"keep only row-wise ops .* \(dropout after the expert, not inside it\)")])
def test_routed_experts_in_a_form_that_cannot_be_stacked_are_refused_with_reason_and_fix(
        layer, expert, reason, fix):
    """A list of experts each on rows routed to it, written in a form the stacked program does
    not run, is named with the line and what to change, not "no mixture-of-experts layer"."""
    model = _patched(layer, expert)
    spec = load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2"])
    with pytest.raises(PlanError, match=r"mesh.ep=2: the experts of layers.0.feed_forward.experts "
                                        r".* cannot be stacked into one grouped computation: "
                                        + reason + r".*Fix: " + fix):
        compile_module(model, _module("mistral_moe_reference").example_inputs(), spec,
                       _module("mistral_moe_reference").loss_fn, reference=False)


def test_expert_called_once_per_top_k_choice_is_refused_naming_the_call(tmp_path):
    """The loop over top-k choices outside the loop over experts calls each expert k times:
    the error names the line of the call (in the user's file, not the expert's forward)."""
    source = (MODELS / "mistral_moe_reference.py").read_text().replace(
        """        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])""",
        """        for k in range(TOP_K):
            for i, expert in enumerate(self.experts):
                idx = torch.where(selected_experts[:, k] == i)[0]
                results[idx] += weights[idx, k, None] * expert(inputs[idx])""")
    path = tmp_path / "per_choice.py"
    path.write_text(source)
    line = source.splitlines().index("                results[idx] += weights[idx, k, None] * "
                                     "expert(inputs[idx])") + 1
    with pytest.raises(PlanError, match=rf"layers.0.feed_forward.experts.0 is called 2 times \(at "
                                        rf"per_choice.py:{line}; layers.0.feed_forward.experts.0.w1"
                                        rf".weight is read each time\).*Fix: give each expert all "
                                        rf"its rows in one call"):
        compile_model(path, load_spec(SPEC, ["mesh.dp=2", "mesh.ep=2"]), weights=False)


def _branches(self, inputs):
    return sum(e(inputs) for e in self.experts) / len(self.experts)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(32, 8, bias=False) for _ in range(3))

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Heads(nn.Module):
    """Attention heads as a list of modules (the way nanoGPT's lecture code writes them)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(_Head() for _ in range(4))

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)


def test_lists_of_modules_on_the_same_input_are_no_experts():
    """Router-less parallel branches and attention heads each read the whole input, not rows
    routed to them: no expert layer, nothing reported (ep > 1 then says the model has none)."""
    captured = _captured("mistral_moe_reference", _patched(_branches))
    assert find_module_experts(captured.gm.graph) == ([], [])
    heads = capture(_Heads(), (torch.randn(2, 8, 32),), Path(__file__))
    assert find_module_experts(heads.gm.graph) == ([], [])
