"""The compiler checks its own output before OUT/ is written (issue 23): mutations of a real
plan or rewrite must be compile-time errors naming what is wrong.

- Gradient accounting (analysis/gradient_accounting.py, in ``check_stages``): the dual
  placement analysis re-run on the final stage graphs; a plan.grad_sync without one of the
  derived ``partial_tp`` parameters, or summing one whose gradient is already whole, is an
  internal error naming the parameter's FQN and the op (with the model's source line) that
  made it Partial.
- Execution on a tp rank's shapes (emit/rank_check.py, ``check_program``): each stage's
  emitted module run forward and backward on FakeTensors of the local shapes; a view left
  with the global head count fails there, naming the model's source line. Falcon (multi-query,
  as configured: no biases) at tp2 x pp2 with sequence parallelism and one sequence per
  microbatch: the reduce-scatter's output fed into the model's in-place ``add_`` ("Output 0
  of Op is a view and is being modified inplace", issue 23) is caught the same way with the
  runtime operator as it was (a view), and compiles with the operator as it is.
- A random op that tp cannot draw alike on every rank (planning/dropout.plan_random_ops): a
  draw sharded over tp from its input's values (``bernoulli(p)``), an op with no stream and
  no --verify stand-in (``randint_like`` with a tensor high): refused at tp2, naming the op
  and the line; an LSTM's dropout is a dropout site on the replicated stream.
- A parameter the forward writes in place (``nn.Embedding(max_norm=...)``) at dp2: refused,
  naming it, the op and the line (analysis/parameter_writes.py).
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from parallelizer.analysis.gradient_accounting import check_gradients
from parallelizer.compiler import check_program, check_stages
from parallelizer.errors import PlanError
from parallelizer.runtime import sequence
from test_tp_gradients import HeadNormAttention
from tp_small_models import Hyper, MLPThen, compile_steps, line_of, x_batch

TP2 = {"mesh": {"tp": 2}}
MODEL_FILE = __file__.replace("test_compile_checks.py", "test_tp_gradients.py")


def _without(plan, fqn: str):
    """``plan`` with ``fqn`` dropped from its partial_tp entry (the entry dropped when empty)."""
    out = []
    for e in plan.grad_sync:
        if e["kind"] == "partial_tp":
            e = {**e, "key": [k for k in e["key"] if k != fqn]}
            if not e["key"]:
                continue
        out.append(e)
    return dataclasses.replace(plan, grad_sync=tuple(out))


def test_real_plan_passes_both_checks():
    _, planned, stages, _ = compile_steps(HeadNormAttention(), x_batch(4, 6), TP2)
    (entry,) = [e for e in planned.plan.grad_sync if e["kind"] == "partial_tp"]
    assert entry["key"] == ["k_norm", "q_norm"]
    check_gradients(planned.plan, stages)


def test_dropped_grad_sync_entry_names_the_parameter():
    _, planned, stages, _ = compile_steps(HeadNormAttention(), x_batch(4, 6), TP2)
    line = line_of(MODEL_FILE, "q = self._norm(self.q(x).view(")  # the call of _norm
    with pytest.raises(PlanError, match=rf"the gradient of q_norm \(stage 0\) is Partial over "
                                        rf"tp .*test_tp_gradients.py:{line}.* no partial_tp"):
        check_gradients(_without(planned.plan, "q_norm"), stages)


def test_summing_a_sharded_gradient_over_tp_is_an_error():
    _, planned, stages, _ = compile_steps(HeadNormAttention(), x_batch(4, 6), TP2)
    grad_sync = tuple({**e, "key": e["key"] + ["q.weight"]} if e["kind"] == "partial_tp"
                      else e for e in planned.plan.grad_sync)
    plan = dataclasses.replace(planned.plan, grad_sync=grad_sync)
    with pytest.raises(PlanError, match=r"sums the gradient of q.weight \(stage 0\) over tp, "
                                        r"but it is sharded on dim 0"):
        check_gradients(plan, stages)


def test_replicated_parameter_summed_although_whole_is_an_error():
    """o's input is whole on every rank after g: summing a replicated weight read only by
    replicated compute would make it tp times too large."""
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = HeadNormAttention()
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.attn(x) * self.scale

    _, planned, stages, _ = compile_steps(Scaled(), x_batch(4, 6), TP2)
    grad_sync = tuple({**e, "key": sorted(e["key"] + ["scale"])} if e["kind"] == "partial_tp"
                      else e for e in planned.plan.grad_sync)
    with pytest.raises(PlanError, match=r"sums the gradient of scale .* already whole"):
        check_gradients(dataclasses.replace(planned.plan, grad_sync=grad_sync), stages)


def _drop_rewrite_of_q_view(decision):
    """The tensor_parallel pass's rewrite of q's view to the rank's heads, removed: the view
    keeps the global head count (4) on a rank's 2 heads of q."""
    assert "view" in decision.rewrites, decision.rewrites  # q's, the graph's first view
    del decision.rewrites["view"]


def test_global_head_count_left_in_a_view_is_a_compile_error_naming_the_line():
    analysis, planned, stages, seq = compile_steps(HeadNormAttention(), x_batch(4, 6), TP2,
                                                   mutate_tp=_drop_rewrite_of_q_view)
    checked = check_stages(analysis, planned, stages, seq)  # placements are still right
    line = line_of(MODEL_FILE, "q = self._norm(self.q(x).view(")
    with pytest.raises(PlanError, match=rf"fails on a tp rank's shapes at aten.view.default "
                                        rf"\(\w+\) at test_tp_gradients.py:{line} in the root "
                                        rf"module, stage 0: RuntimeError: shape"):
        check_program(analysis, checked, x_batch(4, 6))


def _falcon():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, use_cache=False,
                                    attn_implementation="sdpa", bos_token_id=1, eos_token_id=2)
    assert cfg.multi_query and not cfg.bias  # as configured
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))}
    return transformers.FalconForCausalLM(cfg), batch


FALCON_SPEC = {"mesh": {"tp": 2, "pp": 2}, "pipeline": {"microbatches": 4}}


def test_falcon_sequence_parallel_inplace_add_compiles(monkeypatch):
    """Falcon at tp2 x pp2, sequence parallelism on, one sequence per microbatch: the
    program executes on a rank's shapes. Falcon's in-place residual ``add_`` into the
    attention's output is captured out of place (frontend/capture.py ``_out_of_place``), so
    the reduce-scatter's output is read, never written."""
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec

    model, batch = _falcon()
    program = compile_module(model, batch, Spec.model_validate(FALCON_SPEC), reference=False)
    assert "sequence parallel: on" in program.report
    source = program.sources["program/stage0.py"].replace("torch.ops.", "")
    assert "aten.add.Tensor(reduce_scatter_to_sequence_parallel_region" in source
    assert "aten.add_.Tensor" not in source


def test_falcon_view_returned_by_reduce_scatter_is_caught_at_compile_time(monkeypatch,
                                                                          in_place_kept):
    """The runtime operator as it was before the fix (its output a view when the moved dims
    hold one element) and Falcon's in-place add_ kept as written: the compile fails naming
    the add_."""
    monkeypatch.setattr(sequence, "_own", lambda t: t.contiguous())
    model, batch = _falcon()
    analysis, planned, stages, seq = compile_steps(model, batch, FALCON_SPEC)
    checked = check_stages(analysis, planned, stages, seq)
    with pytest.raises(PlanError, match=r"fails on a tp rank's shapes at aten.add_.Tensor "
                                        r"\(\w+\) at transformers/models/falcon/modeling_falcon.py:"
                                        r"\d+ in transformer.h.0, stage 0: RuntimeError: "
                                        r"Output 0 of Op is a view and is being modified inplace"):
        check_program(analysis, checked, batch)


class SampledGate(torch.nn.Module):
    """A column/row linear pair whose hidden units are gated by a Bernoulli sample of their
    own sigmoid (a stochastic binary unit): a draw from the values of a tensor sharded over
    tp."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(h * torch.bernoulli(torch.sigmoid(h)))


def test_sharded_draw_from_its_inputs_values_is_refused_at_tp2():
    """A random op whose output is sharded over tp and whose values depend on its input's
    (``bernoulli(p)``): no rank holds the whole ``p`` to draw the unsharded program's tensor
    and keep its block, so the compiler refuses it, naming the op and the model's line; at
    tp1 it compiles (one rank draws it whole). A drop path (replicated) compiles at tp2:
    tests/features/test_random_streams.py."""
    line = line_of(__file__, "h * torch.bernoulli(torch.sigmoid(h))")
    with pytest.raises(PlanError, match=rf"mesh.tp=2: aten.bernoulli.default \(bernoulli\) in "
                                        rf"the root module at test_compile_checks.py:{line} "
                                        rf"draws a tensor sharded over tp \(Shard\(2\)\) from "
                                        rf"the values of its input"):
        compile_steps(SampledGate(), x_batch(4, 6), TP2)
    _analysis, planned, _stages, _seq = compile_steps(SampledGate(), x_batch(4, 6),
                                                      {"mesh": {"tp": 1}})
    assert [(r["op"], r["dim"]) for r in planned.plan.random] == [("aten.bernoulli.default", None)]


class LSTMHead(torch.nn.Module):
    """An LSTM with dropout between its layers, then a linear pair."""

    def __init__(self, dropout: float):
        super().__init__()
        self.lstm = torch.nn.LSTM(32, 32, num_layers=2, dropout=dropout, batch_first=True)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.lstm(x)[0])))


def test_an_rnns_dropout_draws_from_the_replicated_stream_at_tp2():
    """``aten.lstm``'s dropout between layers is a dropout site (refused at tp2 before, and
    at dp2 --verify failed: the program drew it while the reference had dropout off): the
    replicated stream, so every tp rank draws one mask for the LSTM it computes whole."""
    _analysis, planned, _stages, _seq = compile_steps(LSTMHead(0.1), x_batch(4, 6), TP2)
    assert [(d["op"], d["stream"]) for d in planned.plan.dropout] == [
        ("aten.lstm.input", "replicated")]
    _analysis, planned, _stages, _seq = compile_steps(LSTMHead(0.0), x_batch(4, 6), TP2)
    assert planned.plan.dropout == ()


class RandintHigh(torch.nn.Module):
    """Noise from ``randint_like`` with a tensor ``high``: a random op without a stream."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h + torch.randint_like(h, torch.tensor(5)))


def test_random_op_without_a_stand_in_is_refused_at_tp2():
    """An op that draws with no stream and no --verify stand-in is refused at tp2, naming
    it, its line and the ops the program can draw."""
    line = line_of(__file__, "return self.down(h + torch.randint_like(h, torch.tensor(5)))")
    with pytest.raises(PlanError, match=rf"mesh.tp=2: aten.randint_like.Tensor \(randint_like\) "
                                        rf"in the root module at test_compile_checks.py:{line} "
                                        rf"has no random stream") as e:
        compile_steps(RandintHigh(), x_batch(4, 6), TP2)
    assert "Draw it with torch.rand / randn / randint (with an int high)" in str(e.value)


class RenormedEmbedding(torch.nn.Module):
    """``nn.Embedding(max_norm=1.0)``: forward renormalises the rows it looks up in place."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32, max_norm=1.0)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 64)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.emb(ids))))


def test_a_parameter_written_in_forward_is_refused_at_dp2():
    """At dp2 each rank renormalised only the rows of its own samples (DDP) or a gathered
    copy FSDP2 dropped: --verify FAILed on the parameters after the step, with no word at
    compile time (a break test). Refused, naming the parameter, the op and its line; dp1
    compiles."""
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    ids = (torch.randint(0, 64, (4, 6)),)
    spec = Spec.model_validate({"mesh": {"dp": 2}})
    line = line_of(__file__, "return self.down(torch.relu(self.up(self.emb(ids))))")
    with pytest.raises(PlanError, match=rf"mesh.dp=2: the model's forward writes parameter "
                                        rf"emb.weight in place \(aten.embedding_renorm_.default "
                                        rf"\(embedding_renorm_\) in emb at test_compile_checks.py:{line}"):
        compiler.compile_module(RenormedEmbedding(), ids, spec, reference=False)
    compiler.compile_module(RenormedEmbedding(), ids, Spec.model_validate({"mesh": {"tp": 2}}),
                            reference=False)


class SpectralBlocks(torch.nn.Module):
    """Blocks whose output projection is under ``parametrizations.spectral_norm``: its power
    iteration runs under ``torch.no_grad`` and writes ``div(..., out=self._u)``."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm
        self.ups = torch.nn.ModuleList(torch.nn.Linear(32, 64) for _ in range(2))
        self.downs = torch.nn.ModuleList(spectral_norm(torch.nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x):
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.relu(up(x)))
        return x


def test_a_no_grad_region_writing_out_is_compiled_and_its_buffer_updates_warned():
    """The no_grad region, inlined, tracked gradients from the weight and ``div.out`` raised
    at the compile-time rank check (an internal error at every layout: a break test); its
    inputs are now detached. Under microbatches the power iteration runs once per
    microbatch: warned."""
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    x = (torch.randn(4, 6, 32),)
    compiler.compile_module(SpectralBlocks(), x, Spec.model_validate({"mesh": {"tp": 1}}),
                            reference=False)
    # each up reaches the next block's only past its residual add: down is no linear's
    with pytest.raises(PlanError, match=r"ups\.0\.weight's reaches ups\.1\.weight only past "
                                        r"one; a weight computed in forward "
                                        r"\(torch.nn.utils.parametrizations"):
        compiler.compile_module(SpectralBlocks(), x, Spec.model_validate({"mesh": {"tp": 2}}),
                                reference=False)
    program = compiler.compile_module(SpectralBlocks(), x, Spec.model_validate(
        {"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}}), reference=False)
    assert any(w.startswith("forward writes buffer downs.0.parametrizations.weight.0._u and 3 "
                            "more in place (aten.div.out at test_compile_checks.py:")
               for w in program.warnings), program.warnings


def test_a_rank_check_failure_prints_its_error_alone(monkeypatch):
    """A meta kernel failing at the rank check: FakeTensor's logger wrote its traceback, ~40
    lines of ``E... fake_tensor.py`` on stderr, before the check's error that names the op
    and line (zoo 23 F1). An all-gather stand-in that gathers nothing makes one fail."""
    from parallelizer.runtime.tp import ShapeTransport
    torch.manual_seed(0)
    analysis, planned, stages, seq = compile_steps(MLPThen(Hyper(), 4), x_batch(4, 6), TP2)
    checked = check_stages(analysis, planned, stages, seq)
    monkeypatch.setattr(ShapeTransport, "all_gather", lambda self, t: [t])
    logged, handler = [], logging.Handler()
    handler.emit = logged.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        with pytest.raises(PlanError, match="fails on a tp rank's shapes at aten.linear.default"):
            check_program(analysis, checked, x_batch(4, 6))
    finally:
        log.removeHandler(handler)
    assert not logged, [r.getMessage() for r in logged]
