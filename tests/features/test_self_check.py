"""The numerics self-check (emit/numerics_check.py, compiler.self_check; issue 23 part 3):
every tp rank of the emitted program run in one process on the example batch and compared
with the unmodified model, outputs and every gradient, before OUT/ is written.

- Real transformers models pass at tp2: Qwen3 (its per-head q_norm / k_norm gradients
  Partial, summed by plan.grad_sync), GPT-2 (fused q|k|v of Conv1D), and a tied-embedding
  Llama at tp2 x pp2 (stages chained, the tied copies' gradients summed).
- Broken programs the shape check and the gradient accounting pass are compile errors
  naming the tensor: GPT-2's fused c_attn cut as an even split (pieces in the wrong order:
  output 0 differs), a partial_tp entry dropped after the accounting (q_norm's gradient
  differs), the tensor_parallel pass dropping a g (through the CLI: exit 2, nothing written).
- A correct program whose gradient is rounding only (a bias before a BatchNorm, outputs
  scaled by 1e3) passes: past the fixed tolerance the check allows 8 x the model's own
  float64 rounding error, as run.py --verify does; the broken programs above still fail.
- ``auto`` skips a model above ``self_check.max_params`` (the broken program then compiles);
  ``--no-self-check`` skips it; ``--self-check`` on a program it cannot check is an error.
"""
from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer import compiler
from parallelizer.cli import parallelize as cli
from parallelizer.emit import numerics_check, numerics_compare
from parallelizer.emit.tp_threads import Exchange
from parallelizer.errors import PlanError
from parallelizer.frontend.spec import SelfCheck, Spec
from parallelizer.runtime.tp import reduce_from_tp_region
import tp_zoo_models as zoo
from test_tp_gradients import HeadNormAttention
from tp_small_models import compile_steps, ids_batch, tiny_llama, x_batch

TP2 = {"mesh": {"tp": 2}}
NOTE = r"self-check: 2 tp rank\(s\) of the program against the model on the example batch"
DIFFERS = r"internal error \(a bug in parallelizer, please report it\): the numerics self-check"


def _zoo(name):
    model, ids, _ = getattr(zoo, name)()
    return model, ids(2, 8)


@pytest.mark.parametrize("name, spec", [
    ("qwen3", TP2), ("qwen3", {"mesh": {"tp": 4}}), ("gpt2", TP2), ("olmo2", {"mesh": {"tp": 4}}),
    ("llama", {"mesh": {"tp": 2, "pp": 2}, "pipeline": {"microbatches": 2}})])
def test_real_models_pass_the_self_check(name, spec):
    model, batch = (tiny_llama().train(), ids_batch(4, 8)) if name == "llama" else _zoo(name)
    program = compiler.compile_module(model, batch, Spec.model_validate(spec), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    tp = spec["mesh"]["tp"]
    assert re.match(NOTE.replace("2", str(tp), 1), note), note
    if name == "qwen3":  # the sums the check applies before comparing
        assert any(e["kind"] == "partial_tp" for e in program.plan.grad_sync)
    if name == "qwen3" and tp == 4:  # 2 kv heads at tp 4: each copied to 2 ranks, also
        # through k_norm's mean over head_dim (it ended the copies: "must divide the heads")
        k = program.plan.tensors["model.layers.0.self_attn.k_proj.weight"]
        assert k.layout is not None and k.layout.kind == "replicated_heads", k.layout
        assert any(e["kind"] == "replicated_heads" for e in program.plan.grad_sync)
    if name == "llama":
        assert any(e["kind"] == "tied" for e in program.plan.grad_sync)
    if name == "olmo2":  # k_proj whole, attention cutting each rank's copy of its kv head
        assert any(n.startswith("tensor parallel: 12 of 14 weight matrices") for n in program.notes)
        assert program.plan.tensors["model.layers.0.self_attn.k_proj.weight"].tp_dim is None


def _checked(model, batch, spec, mutate_plan=None, mutate_stages=None):
    """The compiler's steps through check_program (both earlier checks pass), with the plan
    or the stage graphs broken after the gradient accounting."""
    analysis, planned, stages, seq = compile_steps(model, batch, spec)
    checked = compiler.check_stages(analysis, planned, stages, seq)
    if mutate_plan is not None:
        checked = dataclasses.replace(checked, plan=mutate_plan(checked.plan))
    if mutate_stages is not None:
        mutate_stages(checked.stages)
    sources = compiler.check_program(analysis, checked, batch)
    return lambda: compiler.self_check(analysis, checked, Spec.model_validate(spec), batch,
                                       sources, True)


def test_fused_qkv_cut_in_the_wrong_order_is_a_compile_error():
    """GPT-2's c_attn (32, 96) is q|k|v along dim 1 (layout fused): cut as an even split,
    rank 0 holds q and half of k, with the shapes of the right cut."""
    fqn = "transformer.h.0.attn.c_attn.weight"

    def even_split(plan):
        assert plan.tensors[fqn].layout is not None
        return dataclasses.replace(plan, tensors={
            k: dataclasses.replace(v, layout=None) if k == fqn else v
            for k, v in plan.tensors.items()})

    run = _checked(*_zoo("gpt2"), TP2, mutate_plan=even_split)
    with pytest.raises(PlanError, match=rf"{DIFFERS} .* differs first at output 0: max abs error "
                                        rf"[\d.e+-]+ on tp rank 0; compile with mesh.tp=1"):
        run()


def test_missing_partial_sum_names_the_parameter():
    """q_norm's gradient is Partial over tp; a grad_sync without it (past the accounting)
    leaves each rank its heads' share: the check names the parameter."""
    def without_q_norm(plan):
        return dataclasses.replace(plan, grad_sync=tuple(
            {**e, "key": [k for k in e["key"] if k != "q_norm"]} if e["kind"] == "partial_tp"
            else e for e in plan.grad_sync))

    torch.manual_seed(0)
    run = _checked(HeadNormAttention(), x_batch(4, 6), TP2, mutate_plan=without_q_norm)
    with pytest.raises(PlanError, match=rf"{DIFFERS} .* differs first at the gradient of q_norm: "
                                        rf"max abs error [\d.e+-]+ on tp rank 0's piece"):
        run()


def test_a_rank_failing_is_a_compile_error_naming_the_rank(monkeypatch):
    """Rank 1 raising in its first collective: its error is the one reported (rank 0's
    broken barrier is the consequence)."""
    real = Exchange.exchange

    def fails_on_rank_1(self, what, t):
        if self.rank() == 1:
            raise RuntimeError("lost rank")
        return real(self, what, t)

    torch.manual_seed(0)
    run = _checked(HeadNormAttention(), x_batch(4, 6), TP2)
    monkeypatch.setattr(Exchange, "exchange", fails_on_rank_1)
    with pytest.raises(PlanError, match=r"fails in the numerics self-check on tp rank 1 in the "
                                        r"forward of stage 0: RuntimeError: lost rank"):
        run()


MODEL_PY = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def build_model():
    return MLP()


def example_inputs():
    return (torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0)),)
'''


@pytest.fixture
def drops_a_g(monkeypatch):
    """The tensor_parallel pass, then its first g removed (the row linear's Partial output
    left unsummed: no bias, so no gradient shows it to the accounting)."""
    real = compiler.apply_tensor_parallel

    def broken(gm, decision):
        changed = real(gm, decision)
        g = next(n for n in gm.graph.nodes if n.target is reduce_from_tp_region)
        g.replace_all_uses_with(g.args[0])
        gm.graph.erase_node(g)
        gm.recompile()
        return changed

    monkeypatch.setattr(compiler, "apply_tensor_parallel", broken)


def _cli(tmp_path, capsys, *flags, model_py=MODEL_PY):
    (tmp_path / "model.py").write_text(model_py)
    (tmp_path / "spec.yaml").write_text("mesh: {tp: 2}\n")
    out = tmp_path / "out"
    code = cli.main([str(tmp_path / "model.py"), str(tmp_path / "spec.yaml"), "-o", str(out),
                     *flags])
    return code, capsys.readouterr(), out


def test_dropped_g_fails_the_compile_and_writes_nothing(tmp_path, capsys, drops_a_g):
    code, io, out = _cli(tmp_path, capsys)
    assert code == 3 and not out.exists(), io
    assert io.err.startswith("error: internal error (a bug in parallelizer")
    assert "differs first at output 0: max abs error" in io.err
    assert "compile with mesh.tp=1 meanwhile" in io.err


def test_no_self_check_flag_and_auto_bound_skip_it(tmp_path, capsys, drops_a_g):
    code, io, out = _cli(tmp_path, capsys, "--no-self-check")
    assert code == 0 and out.exists() and "self-check" not in io.out, io
    code, io, _ = _cli(tmp_path, capsys, "self_check.max_params=1000")
    assert code == 0, io
    assert ("self-check: skipped (4,096 parameters > self_check.max_params (1,000); "
            "--self-check forces it)") in io.out
    code, io, _ = _cli(tmp_path, capsys, "self_check.max_params=1000", "--self-check")
    assert code == 3 and "differs first at output 0" in io.err, io
    # the default bound is the step's compute, not the inputs' size; both may be set
    code, io, _ = _cli(tmp_path, capsys, "self_check.max_gflops=0")
    assert code == 0, io
    assert re.search(r"self-check: skipped \(a step of the example batch costs [0-9]+ GFLOPs > "
                     r"self_check.max_gflops \(0\); --self-check forces it\)", io.out), io.out
    code, io, _ = _cli(tmp_path, capsys, "self_check.max_input_elements=4")
    assert code == 0 and "elements > self_check.max_input_elements (4)" in io.out, io


def test_forced_self_check_it_cannot_run_is_an_error():
    """--self-check needs the weights, fp32 and mesh.ep = 1 (auto skips, saying why)."""
    model = HeadNormAttention()
    forced, auto = SelfCheck(mode=True), SelfCheck()
    tp2 = types.SimpleNamespace(ep=1, mesh={"tp": 2}, input_names=("x",), inputs_are_kwargs=False,
                                structure={})
    cases = [(model, tp2, False, "the model has no weights"),
             (HeadNormAttention().double(), tp2, True, r"it compares in fp32 and q_norm is float64"),
             (model, types.SimpleNamespace(ep=2, mesh={"tp": 1}), True,
              r"mesh.ep=2 \(expert parallelism is not simulated")]
    for m, plan, weights, why in cases:
        with pytest.raises(PlanError, match=rf"self_check.mode=true \(--self-check\) cannot "
                                            rf"run: {why}"):
            numerics_check.when(forced, plan, m, x_batch(2, 4), weights)
    skipped = numerics_check.when(auto, tp2, model, x_batch(2, 4), False)
    assert not skipped.run and not skipped.forceable and skipped.note == (
        "self-check: skipped (the model has no weights (--no-weights or a meta-device model))")
    assert numerics_check.when(auto, tp2, model, x_batch(2, 4), True).run


BF16_MODEL_PY = MODEL_PY.replace(
    "return self.down(torch.relu(self.up(x)))",
    "h = torch.relu(self.up(x.to(torch.bfloat16).to(torch.float32) * 1.0))\n"
    "        return nn.functional.linear(h.to(torch.bfloat16), "
    "self.down.weight.to(torch.bfloat16)).float()")


def test_a_model_computing_in_bf16_is_checked_at_its_rounding(tmp_path, capsys):
    """A new user's model computing its projection in bfloat16 was refused as 'internal
    error' at fp32's 1e-4 (its own bf16 rounding, as --verify confirmed). The check now
    compares within 4 bf16 units and says so."""
    code, io, out = _cli(tmp_path, capsys, model_py=BF16_MODEL_PY)
    assert code == 0 and out.exists(), io
    assert "of the tolerance (bfloat16's, the dtype the model computes in)" in io.out, io.out


def test_a_dropped_g_is_caught_at_the_bf16_tolerance_too(tmp_path, capsys, drops_a_g):
    code, io, out = _cli(tmp_path, capsys, model_py=BF16_MODEL_PY)
    assert code == 3 and not out.exists(), io
    assert "fp32, the model computing in bfloat16, atol=0.03125" in io.err
    assert "differs first at output 0: max abs error" in io.err


MASKED_TEMPERATURE_PY = '''
import torch
from torch import nn


class Attention(nn.Module):
    """A learned per-head temperature multiplied into scores already masked with -inf: its
    own gradient is 0 x inf = nan (a new user's model, found by a break test)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.temp = nn.Parameter(torch.linspace(0.5, 1.5, heads).view(heads, 1, 1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) + torch.full((t, t), float("-inf")).triu(1)
        p = (s * self.temp).softmax(-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, d))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Attention(), Attention())


def example_inputs():
    return (torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0)),)
'''


def test_the_models_own_nan_gradient_is_matched_and_warned(tmp_path, capsys):
    """The model's gradient of ``temp`` is nan on the example batch: the program's nan there
    is a match, not an 'internal error'; the compile warns, naming the parameter."""
    code, io, out = _cli(tmp_path, capsys, "--self-check", model_py=MASKED_TEMPERATURE_PY)
    assert code == 0 and out.exists(), io
    assert "self-check: 2 tp rank(s)" in io.out
    assert ("warning: the unmodified model's own gradient of 0.temp is not finite on the "
            "example batch (4 of 4 elements nan); also 1.temp.") in io.err, io.err


def test_nan_matches_only_nan_at_the_same_element():
    """numerics_compare.error and verify.within: the reference's nan or inf must be the
    program's at the same element; a nan where the reference is finite is an error."""
    from parallelizer.runtime.verify import within
    nan, inf = float("nan"), float("inf")
    want = torch.tensor([1.0, nan, -inf])
    for got, ok in ((torch.tensor([1.0, nan, -inf]), True), (torch.tensor([1.0, 0.0, -inf]), False),
                    (torch.tensor([1.0, nan, inf]), False), (torch.tensor([nan, nan, -inf]), False),
                    (torch.tensor([1.5, nan, -inf]), False)):
        assert within(got, want, 1e-5, 1e-5) is ok, got
        assert numerics_compare.error(got, want, [0.0])[1] is (not ok), got


class _CheckpointedBlock(torch.nn.Module):
    """A block run through torch.utils.checkpoint with dropout and a drop path inside."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def _inner(self, x):
        h = self.down(torch.nn.functional.dropout(torch.relu(self.up(x)), 0.1, self.training))
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(0.9)  # drop path
        return x + h * keep / 0.9

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self._inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_with_random_ops_have_a_true_reference(reentrant):
    """The backward's recompute of a checkpointed block ran outside the reference's
    dropout-off and stand-in modes: dropout active in the recompute only (torch's
    CheckpointError "different metadata", a raw traceback at every layout) and real drop
    path masks (a wrong reference: 'internal error' at tp2, a --verify FAIL at tp1). The
    reference runs checkpoint as a plain call (rng.checkpoint_off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_CheckpointedBlock(reentrant), _CheckpointedBlock(reentrant))
    program = compiler.compile_module(model.train(), x_batch(4, 6), Spec.model_validate(TP2))
    assert any(re.match(NOTE, n) for n in program.notes), program.notes
    assert program.reference["grad.0.up.weight"].abs().max() > 0


class Scaled(nn.Module):
    """A depthwise conv's bias before a BatchNorm (its gradient is rounding only) under
    outputs scaled by 1e3: a fixed tolerance failed this correct program (Parakeet's
    encoder, gradients of 1e6, the compile refused it as a bug)."""

    def __init__(self, d=8):
        super().__init__()
        self.pw1, self.pw2 = nn.Conv1d(d, d, 1), nn.Conv1d(d, d, 1)
        self.dw = nn.Conv1d(d, d, 3, padding=1, groups=d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return 1e3 * self.pw2(F.silu(self.bn(self.dw(self.pw1(x)))))


def test_the_self_check_allows_the_models_own_rounding_error():
    torch.manual_seed(0)
    x = (torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(0)),)
    program = compiler.compile_module(Scaled().train(), x, Spec.model_validate(
        {"mesh": {"tp": 2}}), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "at most" in note and "and 8 x the model's own rounding error (its float64 step)" \
        in note, note


class _DrawsUncovered(nn.Module):
    """Draws with an op the stand-ins do not cover (``Tensor.random_``), as diffusers'
    ``randn(..., generator=None)`` did before it had one (zoo 13 Z17): the float64 step drew
    other values, its difference counted as the model's rounding, and the self-check passed a
    program ``--verify`` failed by 0.16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * torch.empty_like(x).random_(1, 3)


def test_a_reference_that_draws_outside_the_stand_ins_is_refused_not_allowed_for():
    torch.manual_seed(0)
    model, batch = _DrawsUncovered(), (torch.randn(4, 3, 8),)
    want = numerics_check.reference(model, batch)
    with pytest.raises(PlanError) as e:
        numerics_check._check_repeatable(model, batch, want, 0)
    assert "the unmodified model gives another output 0 when torch's generator starts " \
           "elsewhere" in str(e.value) and "fixed stand-ins" in str(e.value), e.value
    plain = nn.Linear(8, 8)
    numerics_check._check_repeatable(plain, batch, numerics_check.reference(plain, batch), 0)
    # a parameter forward never reads has no gradient to compare (it raised AttributeError)
    unused = nn.ModuleDict({"fc": nn.Linear(8, 8), "spare": nn.Linear(8, 8)})
    unused.forward = lambda x: unused["fc"](x)
    want = numerics_check.reference(unused, batch)
    assert want.grads["spare.weight"] is None
    numerics_check._check_repeatable(unused, batch, want, 0)
