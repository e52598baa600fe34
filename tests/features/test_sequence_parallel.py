"""Sequence parallelism (Korthikanti et al. 2022, §4.2.2): planner, pass and runtime operators.

Numerics: the tp- and sequence-parallel-rewritten graph runs as tp ranks in lockstep in one
process (tests/tp_lockstep.py: runtime/sequence.py's own autograd operators, only the
transport is threads); outputs, every gradient (norm weights and row biases included, which
each rank sees only for its sequence shard) and the parameters after an SGD step equal the
unmodified model's. Dropout: a rank's shard gets its slice of the unsharded mask. Spec key:
``tensor_parallel.sequence_parallel`` auto | true | false.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from parallelizer.errors import PlanError  # noqa: E402
from parallelizer.frontend.capture import capture  # noqa: E402
from parallelizer.passes.cleanup import apply_cleanup  # noqa: E402
from parallelizer.passes.sequence_parallel import apply_sequence_parallel  # noqa: E402
from parallelizer.passes.tensor_parallel import apply_tensor_parallel  # noqa: E402
from parallelizer.planning.sequence import plan_sequence_parallel  # noqa: E402
from parallelizer.planning.tp import plan_tp  # noqa: E402
from parallelizer.runtime import sequence as sp  # noqa: E402
from parallelizer.runtime.rng import random_op  # noqa: E402
from parallelizer.runtime.tp import copy_to_tp_region, reduce_from_tp_region  # noqa: E402

from tp_lockstep import local, run_ranks  # noqa: E402
from tp_zoo_models import EXAMPLES, ZOO  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1


def _loss(outs):
    g = torch.Generator().manual_seed(7)
    tensors = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return sum((o * torch.randn(o.shape, generator=g)).mean() for o in tensors)


def _call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def _rewrite(model, batch, tp, mode="auto"):
    cap = capture(model, batch, Path("sp"))
    gm = cap.gm
    d = plan_tp(gm.graph, tp)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    s = plan_sequence_parallel(gm.graph, tp, mode, d.placements)
    apply_sequence_parallel(gm, s)
    return cap, gm, d, s


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


# llama: RMSNorm, 3-D linears; gpt2: Conv1D on (batch * seq, hidden), position embedding
# entering the region; gpt: nanoGPT's (seq, hidden) position embedding; opt: post-attention
# layer norm with biases, learned positions
CASES = [("example_llama", 2), ("example_gpt2", 2), ("example_gpt", 2), ("opt", 2),
         ("example_llama", 4)]


@pytest.mark.parametrize("name,tp", CASES)
def test_sequence_parallel_matches_unmodified_model(name, tp):
    model, batch_of, _ = {**ZOO, **EXAMPLES}[name]()
    model.train()
    cap, gm, d, s = _rewrite(model, batch_of(), tp)
    assert s.enabled, s.report
    assert _calls(gm, sp.reduce_scatter_to_sequence_parallel_region)
    assert _calls(gm, sp.gathered_linears)
    batch = batch_of(3, 8, seed=1)
    ref = copy.deepcopy(model)
    ref_outs, _ = tree_flatten(_call(ref, batch))
    _loss(ref_outs).backward()
    named = list(ref.named_parameters(remove_duplicate=False))
    flat = [batch[n] for n in cap.input_names] if isinstance(batch, dict) else list(batch)
    ranks = run_ranks(gm, d, tp, flat, _loss, LR)
    norms = [n for n, p in named if p.dim() == 1 and "norm" in n or "ln" in n]
    assert norms
    for r, res in enumerate(ranks):
        for out, want in zip(res.outputs, ref_outs):
            torch.testing.assert_close(out, want, **TOL)
        for fqn, p in named:
            if fqn not in res.grads:
                continue
            torch.testing.assert_close(res.grads[fqn], local(p.grad, fqn, d, tp, r), **TOL,
                                       msg=lambda m: f"{fqn}: {m}")
            want = local(p.detach() - LR * p.grad, fqn, d, tp, r)
            torch.testing.assert_close(res.params[fqn], want, **TOL, msg=lambda m: f"{fqn}: {m}")
        assert any(n in res.grads for n in norms)


def test_region_covers_norms_and_residuals_of_llama():
    model, batch_of, _ = EXAMPLES["example_llama"]()
    _cap, gm, _d, s = _rewrite(model, batch_of(), 2)
    layers = 4
    # g per attention and MLP, f per attention (q|k|v share one) and MLP (gate|up)
    assert len(s.reduce_scatter) == 2 * layers and len(s.all_gather) == 2 * layers
    # the embedding enters by a slice; only the LM head's input leaves
    assert list(s.splits) == ["embedding"] and len(s.exits) == 1
    # every RMSNorm weight reaches the region through an f (gradient summed over tp)
    params = {a for _n, a in s.param_inputs}
    assert len(params) == 2 * layers + 1
    # no view in llama's region holds the sequence length: no local-length node
    assert not _calls(gm, sp.sequence_shard_length)


def test_sequence_parallel_false_and_tp1_plan_nothing():
    model, x = _SizesAndViews(), (torch.randn(3, 6, 8),)
    _cap, gm, _d, s = _rewrite(model, x, 2, mode="false")
    assert not s.enabled and s.report == [
        "sequence parallel: off (tensor_parallel.sequence_parallel=false)"]
    assert not _calls(gm, sp.reduce_scatter_to_sequence_parallel_region)
    assert _calls(gm, copy_to_tp_region) and _calls(gm, reduce_from_tp_region)
    _cap, _gm, _d, s = _rewrite(model, x, 1)
    assert not s.enabled and not s.report


class _NoRow(torch.nn.Module):
    """Two linears with a cumsum over features between them: tp keeps them replicated
    (allow_replicated), so there is no g to start a region from."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(self.a(x).cumsum_(dim=-1))  # in place: no gathered copy stands in


def _no_row_graph():
    cap = capture(_NoRow(), (torch.randn(2, 4, 8),), Path("norow"))
    d = plan_tp(cap.gm.graph, 2, allow_replicated=True)
    apply_tensor_parallel(cap.gm, d)
    return cap.gm, d


def test_sequence_parallel_true_names_the_blocker(in_place_kept):
    gm, d = _no_row_graph()
    with pytest.raises(PlanError, match=r"tensor_parallel.sequence_parallel=true cannot apply: "
                                        r"no row_parallel linear .*auto or false"):
        plan_sequence_parallel(gm.graph, 2, "true", d.placements)


def test_sequence_parallel_auto_reports_why_off(in_place_kept):
    gm, d = _no_row_graph()
    s = plan_sequence_parallel(gm.graph, 2, "auto", d.placements)
    assert not s.enabled and s.report[0].startswith("sequence parallel: off (no row_parallel")


def test_spec_key_values():
    from parallelizer.frontend.spec import Spec
    assert Spec().tensor_parallel.sequence_parallel_mode == "auto"
    for v, mode in ((True, "true"), (False, "false"), ("auto", "auto")):
        spec = Spec.model_validate({"tensor_parallel": {"sequence_parallel": v}})
        assert spec.tensor_parallel.sequence_parallel_mode == mode
    with pytest.raises(Exception, match="sequence_parallel"):
        Spec.model_validate({"tensor_parallel": {"sequence_parallel": "on"}})


class _Comm:
    """One rank of a 2-rank group, for operators that do not communicate (split, dropout)."""

    def __init__(self, rank, tp=2):
        self._rank, self.tp = rank, tp

    def size(self):
        return self.tp

    def rank(self):
        return self._rank


def test_sequence_length_not_divisible_by_tp_fails_clearly():
    with pytest.raises(sp.SequenceLengthError, match=r"sequence length \(7\) is not divisible "
                                                     r"by mesh.tp \(2\).*sequence_parallel=false"):
        sp.sequence_shard_length(7, 2)
    with pytest.raises(sp.SequenceLengthError, match="not divisible"):
        sp.Split.apply(torch.randn(2, 7, 4), 1, None, _Comm(0))


@pytest.mark.parametrize("op", ["aten.dropout.default", "aten.native_dropout.default"])
@pytest.mark.parametrize("flat", [False, True])
def test_dropout_on_a_shard_applies_its_slice_of_the_full_mask(op, flat):
    """Both ranks' outputs, put together, are bit for bit the unsharded dropout drawn from
    the same generator state (so masks equal the tp program's and, at seed, eager's)."""
    x = torch.randn(2, 6, 5)
    torch.manual_seed(3)
    full = random_op("replicated", op, x, 0.3, True)
    full = full[0] if isinstance(full, tuple) else full
    pieces = []
    for r in range(2):
        torch.manual_seed(3)
        mine = x[:, 3 * r:3 * r + 3]
        if flat:  # (batch * seq / tp, hidden) rows, as GPT-2's Conv1D reads them
            out = sp.random_op_on_sequence_shard("replicated", op, 0, 6, mine.flatten(0, 1),
                                                 0.3, True, comm=_Comm(r))
            out = (out[0] if isinstance(out, tuple) else out).unflatten(0, (2, 3))
        else:
            out = sp.random_op_on_sequence_shard("replicated", op, 1, None, mine, 0.3, True,
                                                 comm=_Comm(r))
            out = out[0] if isinstance(out, tuple) else out
        pieces.append(out)
    assert torch.equal(torch.cat(pieces, 1), full)
    assert (full == 0).any()


# --- estimate: activation bytes per layer (Korthikanti et al. 2022, Table 2) ----------------

def _layer_bytes(tp: int, sequence_parallel: bool) -> tuple[int, dict, list]:
    """Bytes block ``h.1`` of examples/gpt saves per microbatch on one tp rank, counted by
    ``parallelize estimate``'s FakeTensor trace of the emitted stage; the batch shape; the
    compile's printed notes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallelizer.compiler import compile_module
    from parallelizer.advisor.activations import stage_activations
    from parallelizer.advisor.memory import load_stage
    from parallelizer.frontend.model_file import default_loss, load_model
    from parallelizer.frontend.spec import Spec

    gpt = load_model(Path(__file__).parents[2] / "examples/gpt/model.py", on_meta=True)
    batch = gpt.batch
    spec = Spec.model_validate({"mesh": {"tp": tp}, "tensor_parallel": {
        "sequence_parallel": sequence_parallel}})
    program = compile_module(gpt.model, batch, spec, default_loss)
    per_block: dict = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        stages = [load_stage(program.sources[f"program/{st.module}.py"], st.index)
                  for st in program.plan.stages]
        stage_activations(stages, program.plan, batch, default_loss, mode, per_block)
    block = next(b for b in per_block if b.endswith(".1"))
    return per_block[block], batch, program.notes


def test_estimate_activations_shrink_as_korthikanti_table_2():
    """Per layer, TP alone keeps sbh(10 + 24/t + 5as/(ht)) and TP+SP sbh/t (34 + 5as/h)
    (2-byte activations with 1-byte dropout masks): with SP *everything* the layer saves is
    divided by t, i.e. S(t) = P(1) / t; with TP alone a replicated part X stays whole,
    A(t) = X + (P(1) - X) / t. Here fp32 and no dropout, so X is the layer's LayerNorm
    inputs and the inputs of the q|k|v and c_fc linears, 4 sbh elements (Korthikanti's 8 of
    the 10 sbh bytes: LN 4 + linears 4, less the 2 of the masks), plus each LayerNorm's
    (b, s, 1) mean and rstd (4 sb elements, below the paper's resolution)."""
    p1, batch, _ = _layer_bytes(1, False)
    a2, _, off = _layer_bytes(2, False)
    s2, _, on = _layer_bytes(2, True)
    # the compile says which lengths the program then runs (zoo 23 F5: only the run did)
    assert any(n.startswith("sequence parallel: on (") and "multiples of mesh.tp (2)" in n
               and "sequence_parallel=false runs any length" in n for n in on), on
    assert not any(n.startswith("sequence parallel") for n in off), off
    b, s = batch[0].shape if isinstance(batch, (tuple, list)) else next(iter(batch.values())).shape
    h = _hidden_of_gpt_example()
    assert s2 * 2 == p1  # sbh/t (34 + 5as/h): the t = 1 count over t
    x = 2 * a2 - p1  # A(2) = X + (P(1) - X) / 2
    assert x == 4 * (4 * b * s * h + 4 * b * s)  # fp32: LN and linear inputs, LN mean/rstd
    assert a2 - s2 == x // 2  # what SP saves beyond TP: X (1 - 1/t)


def _hidden_of_gpt_example() -> int:
    from parallelizer.frontend.model_file import build_model, load_model_file
    module = load_model_file(Path(__file__).parents[2] / "examples/gpt/model.py")
    model = build_model(module, on_meta=True)
    return model.wte.weight.shape[1]


class _SizesAndViews(torch.nn.Module):
    """A block read straight from the model input (the first norm and the residual add both
    read it), a view into (b, s, 2, 4) and a size read of the sequence inside the region."""

    def __init__(self):
        super().__init__()
        self.ln, self.ln2 = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.ln2(x + self.b(torch.relu(self.a(self.ln(x)))))
        return h.reshape(h.shape[0], h.shape[1], 2, 4).sum(-1) * h.shape[1]


def test_region_takes_input_siblings_views_and_size_reads():
    model, x = _SizesAndViews(), torch.randn(3, 6, 8)
    _cap, gm, d, s = _rewrite(model, (x,), 2)
    assert list(s.splits) == ["x"] and len(s.all_gather) == 1 and len(s.exits) == 1
    assert len(s.views) == 1 and _calls(gm, sp.sequence_shard_length)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    for r, res in enumerate(run_ranks(gm, d, 2, [x], lambda o: o[0].square().sum(), LR)):
        torch.testing.assert_close(res.outputs[0], ref(x), **TOL)
        for fqn in ("ln.weight", "ln2.bias", "b.bias"):
            torch.testing.assert_close(res.grads[fqn], ref.get_parameter(fqn).grad, **TOL)


def test_example_batch_not_divisible_by_tp_turns_auto_off_and_fails_true():
    model, x = _SizesAndViews(), torch.randn(3, 6, 8)
    cap = capture(model, (x,), Path("sv"))
    d = plan_tp(cap.gm.graph, 4)
    apply_tensor_parallel(cap.gm, d)
    s = plan_sequence_parallel(cap.gm.graph, 4, "auto", d.placements, example_seq=6)
    assert not s.enabled and "sequence length (6) is not divisible by mesh.tp (4)" in s.report[0]
    with pytest.raises(PlanError, match=r"sequence_parallel=true cannot apply: the example "
                                        r"batch's sequence length \(6\)"):
        plan_sequence_parallel(cap.gm.graph, 4, "true", d.placements, example_seq=6)


def test_spec_value_other_than_auto_true_false_is_one_spec_error(tmp_path):
    """The allowed phrase, once (not one pydantic line per member of a union)."""
    from parallelizer.errors import SpecError
    from parallelizer.frontend.spec import load_spec
    path = tmp_path / "spec.yaml"
    path.write_text("tensor_parallel: {sequence_parallel: maybe}\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    msg = str(e.value)
    assert "tensor_parallel.sequence_parallel must be one of 'auto', true, false" in msg, msg
    assert "got 'maybe'" in msg and "literal" not in msg and msg.count(" must be ") == 1, msg
    modes = [load_spec(path, [f"tensor_parallel.sequence_parallel={v}"]).tensor_parallel
             .sequence_parallel_mode for v in ("true", "false", "auto")]
    assert modes == ["true", "false", "auto"]


class _Patches(nn.Module):
    """Pixels in: (batch, 3 channels, 8, 8), patchified by a convolution, then an MLP."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        return h + self.fc2(torch.relu(self.fc1(h)))


def test_an_image_input_is_not_called_a_sequence_tp_does_not_divide():
    """The report said "the example batch's sequence length (3) is not divisible by mesh.tp
    (2)" of an image's 3 channels (a break test): dim 1 is a constant of the graph."""
    cap = capture(_Patches(), (torch.randn(2, 3, 8, 8),), Path("patches"))
    d = plan_tp(cap.gm.graph, 2)
    apply_tensor_parallel(cap.gm, d)
    s = plan_sequence_parallel(cap.gm.graph, 2, "auto", d.placements, example_seq=3)
    assert not s.enabled and s.report[0] == (
        "sequence parallel: off (dim 1 of the first model input, 3, is a constant of the captured "
        "graph, no sequence length (an image's channels, a feature dim), and mesh.tp (2) does "
        "not divide it)"), s.report


class _InPlaceAfterColumn(nn.Module):
    """Blocks whose column linears' outputs are modified in place: ``gate.mul_(up)`` and
    nn.ReLU(inplace=True) after it."""

    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.ln(x)
        return x + self.down(self.act(self.gate(h).mul_(self.up(h))))


def test_in_place_ops_on_the_gathered_linears_outputs_compile_and_match():
    """GatheredLinears' outputs were views made inside the custom Function, which autograd
    forbids to modify in place ("Output 0 of GatheredLinears is a view and is being modified
    inplace": the compile's shape check refused the program as an internal error, a break
    test); the views are taken outside it now. The compile's own self-check runs both tp
    ranks against the model."""
    import parallelizer as pz
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), _InPlaceAfterColumn(), _InPlaceAfterColumn(),
                          nn.LayerNorm(16)).train()
    batch = (torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": {"tp": 2}, "self_check": {"mode": True}})
    program = pz.compile(model, spec, batch, reference=False)
    assert any(line.startswith("sequence parallel: on") for line in program.report.splitlines()
               for line in [line.removeprefix("- ")])
    assert any("self-check: 2 tp rank(s)" in n for n in program.notes), program.notes


class _Tabular(nn.Module):
    """(batch, 12 features) rows through a residual MLP, TabNet's shape (zoo 25 F5): dim 1 is
    features, no sequence. 'auto' held the row-parallel output as a shard cut along them,
    and the fused gather + linear after it failed on every rank ("list index out of
    range", an internal error)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 12)
        self.out, self.gate = nn.Linear(12, 3), nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(x + self.fc2(torch.relu(self.fc1(x))))
        return self.out(h) * torch.sigmoid(self.gate(h))  # two linears read h: one gather


def test_a_row_of_features_is_no_sequence():
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    x = (torch.randn(16, 12, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_Tabular(), x, Spec.model_validate({"mesh": {"tp": 2}}))
    assert "- sequence parallel: off (" in program.report and \
        "has no sequence dim (dim 1 of the model's first input)" in program.report
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "self-check: 2 tp rank(s)" in note, note
