"""A size the model's code turns into a Python number (a router's capacity ``int(1.25 *
tokens / experts)``, GShard/Switch style) is traced at the example's value: torch.export keeps
the batch and sequence dims symbolic and guards the expression (``math.trunc(...) == 8``),
and the flat program dropped that guard. So the program ran other sizes with the example's
constant, with no warning: at pp2 each microbatch kept the whole batch's capacity, and
``--verify`` failed (zoo 10's hw10_gshard_top1), and ``run.py --seq-len`` ran a length the
constant was wrong for. Now a guarded dim is fixed at the example's size: the compile warns
naming the guard, ``run.py`` refuses another size (``plan.fixed_sizes``), and a guarded batch
refuses every layout that runs fewer samples at a time.
"""
import math
import re

import pytest
import torch
from torch import nn

from parallelizer import compiler
from parallelizer.errors import PlanError
from parallelizer.frontend.spec import Spec

D = 16


class _Capacity(nn.Module):
    """Keeps the first ``cap`` tokens of each sample; ``cap`` from the tokens it was given."""

    def __init__(self, over_batch: bool):
        super().__init__()
        self.over_batch = over_batch
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        tokens = x.shape[0] * x.shape[1] if self.over_batch else x.shape[1]
        cap = max(1, int(0.125 * tokens))
        keep = (torch.arange(x.shape[1])[None] < cap).to(x.dtype)
        return (self.b(self.a(x)) ** 2).mean(-1).mul(keep).sum(1).div(cap).mean()


def _compile(over_batch: bool, **mesh):
    torch.manual_seed(0)
    batch = (torch.randn(4, 16, D, generator=torch.Generator().manual_seed(1)),)
    return compiler.compile_module(_Capacity(over_batch), batch,
                                   Spec.model_validate({"mesh": mesh}))


def test_a_guarded_sequence_length_is_fixed_and_said():
    program = _compile(False)
    assert ("x", 1, 16) in program.plan.fixed_sizes
    (warning,) = [w for w in program.warnings if "fixes the sequence length" in w]
    assert "torch.export guarded `math.trunc(0.125*torch.sym_float(L['x'].size()[1])) == 2`" \
        in warning and "run.py refuses another --seq-len" in warning


def test_a_guarded_batch_refuses_layouts_that_run_fewer_samples():
    with pytest.raises(PlanError, match=r"fixes the batch size at the example's 4: it turns "
                                        r"dim 0 of input 'x' into a Python number .*guarded "
                                        r"`math\.trunc\(.*== 8`.*mesh\.dp > 1"):
        _compile(True, dp=2)
    assert ("x", 0, 4) in _compile(True).plan.fixed_sizes


class _ChunkedHead(nn.Module):
    """torchtune's chunked output (``set_num_output_chunks``): the LM head per chunk of the
    sequence. torch.export guards a batch other than 1 there (``64*B*r != 64*r``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 64)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return [self.head(c) for c in h.chunk(4, dim=1)]


def test_a_guard_excluding_one_sample_asks_for_two_not_a_fixed_batch():
    """The refusal said "fixes the batch size at the example's 4" (zoo 11 F4), which a batch
    of 8 over the same 4 chunks disproves: it names the fewest samples per microbatch
    the guard holds for and the fix."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"dp": 2}, "pipeline": {"microbatches": 2}})
    with pytest.raises(PlanError) as e:
        compiler.compile_module(_ChunkedHead(), (torch.randn(4, 16, D),), spec)
    msg = str(e.value)
    assert msg.startswith("the model's code needs at least 2 samples at a time: torch.export "
                          "guarded `"), msg
    assert "which 1 sample(s) break (the example batch of 4 cut into 4: mesh.dp x " \
        "pipeline.microbatches). Use fewer microbatches" in msg and "fixes" not in msg, msg
    program = compiler.compile_module(_ChunkedHead(), (torch.randn(8, 16, D),), spec)
    assert program.plan.fixed_sizes == ()


class _GhostNorm(nn.Module):
    """TabNet's ghost batch norm: ``x.chunk(int(np.ceil(B / vbs)))``, statistics per chunk.
    At 8 samples torch.export guards ``ceil(B / 4) == 2``: 5 to 8 samples hold it, so the
    refusal at dp2 said "needs at least 5 samples ... use a larger example batch", and a
    larger batch only moved the guard with it (zoo 25 F6)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        parts = x.chunk(math.ceil(x.shape[0] / 4), 0)
        return self.fc(torch.cat([p - p.mean(0) for p in parts])).pow(2).mean()


def test_a_guard_holding_for_a_range_of_batches_says_the_range():
    torch.manual_seed(0)
    with pytest.raises(PlanError) as e:
        compiler.compile_module(_GhostNorm(), (torch.randn(8, D),),
                                Spec.model_validate({"mesh": {"dp": 2}}))
    msg = str(e.value)
    assert msg.startswith("the model's code runs 5 to 8 samples at a time, a range around the "
                          "example's: torch.export guarded `"), msg
    assert "A larger example batch moves the range with it" in msg and \
        "use mesh.pp=1, mesh.dp=1 and pipeline.microbatches=1" in msg, msg


def test_a_least_of_two_at_an_example_batch_of_two_is_no_fixed_batch():
    """At an example batch of 2 cut into 2 microbatches the least (2) equals the example,
    and the refusal said the code "fixes the batch size at the example's 2" with the fix
    "use mesh.pp=1" (zoo 14 F11, WavLM's ``B != 1`` guard); twice the batch holds the guard
    too, so the least is named."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"pp": 1}, "pipeline": {"microbatches": 2}})
    with pytest.raises(PlanError) as e:
        compiler.compile_module(_ChunkedHead(), (torch.randn(2, 16, D),), spec)
    msg = str(e.value)
    assert msg.startswith("the model's code needs at least 2 samples at a time"), msg
    assert "which 1 sample(s) break (the example batch of 2 cut into 2" in msg, msg


class _CausalIfLonger(nn.Module):
    """openai-whisper's ``is_causal = mask is not None and n_ctx > 1`` given to SDPA, which
    takes a Python bool: with the length symbolic, export fails ("argument 'is_causal' must
    be bool, not SymBool") and the model was refused (zoo 13 Z3). The capture now falls back
    to the example's length, said by the warning with the first capture's error."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        return x + self.out(y.transpose(1, 2).reshape(b, n, D))


def test_a_length_the_code_needs_as_a_number_is_captured_fixed_and_said():
    torch.manual_seed(0)
    batch = (torch.randn(4, 16, D, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_CausalIfLonger(), batch,
                                      Spec.model_validate({"mesh": {"tp": 2}}))
    assert ("x", 1, 16) in program.plan.fixed_sizes
    (warning,) = [w for w in program.warnings if "fixes the sequence length" in w]
    assert warning.startswith("the model's code fixes the sequence length at the example's 16: "
                              "captured with it symbolic, it fails (TypeError: "
                              "scaled_dot_product_attention(): argument 'is_causal' must be "
                              "bool, not SymBool"), warning
    assert "run.py refuses another --seq-len" in warning
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes


class _SampledLatent(nn.Module):
    """diffusers' ``randn_tensor`` draws ``torch.randn(shape, generator=None, device=...,
    dtype=..., layout=...)``: the ``randn.generator`` overload, which has no symbolic sizes
    ("SymIntArrayRef expected to contain only concrete integers") and no random stream, so the
    model was refused naming no line (zoo 13 Z17). Captured at the example's sizes now (a
    failed export's marks on the inputs dropped), the draw is the default generator's, and
    the reference's eager draw has its stand-in too (else the self-check's float64 estimate
    took the draw's difference for rounding)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D, 2 * D)
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        mean, logvar = self.enc(x).chunk(2, -1)
        z = mean + (0.5 * logvar).exp() * torch.randn(
            mean.shape, generator=None, device=mean.device, dtype=mean.dtype,
            layout=torch.strided)
        return z + self.b(torch.relu(self.a(z)))


def test_a_draw_given_generator_none_is_captured_at_the_example_sizes():
    torch.manual_seed(0)
    batch = (torch.randn(4, 16, D, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_SampledLatent(), batch,
                                      Spec.model_validate({"mesh": {"tp": 2}}))
    assert {("x", 0, 4), ("x", 1, 16)} <= set(program.plan.fixed_sizes)
    (warning,) = [w for w in program.warnings if "fixes the batch size" in w]
    assert "captured with it symbolic, it fails (RuntimeError: " in warning \
        and "so dim 0 of input 'x' was captured as that number" in warning, warning
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "8 x the model's own rounding error" not in note, note
    assert float(re.search(r"1 output\(s\) max abs err ([0-9.e-]+)", note)[1]) < 1e-5, note


class _MaskBuffer(nn.Module):
    """nanoGPT's non-flash attention: a causal mask buffer of 32 rows sliced by the length
    (``self.bias[:, :, :T, :T]``). torch.export guards ``T <= 32`` and ``T != 32`` there; the
    second was read as fixing the length (doubling the example's 16 breaks it), so the
    compile warned that the length was fixed and run.py refused every other (zoo 15 Z3)."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(64, D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("mask", torch.tril(torch.ones(32, 32)))

    def forward(self, ids):
        x = self.emb(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)).masked_fill(self.mask[:t, :t] == 0, float("-inf"))
        return x + self.out((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))


def test_a_guard_excluding_one_length_keeps_the_others_and_run_py_refuses_that_one():
    from parallelizer.errors import UserError
    from parallelizer.plan.parallel_plan import ParallelPlan
    from parallelizer.runtime.data_source import check_fixed_sizes

    torch.manual_seed(0)
    ids = (torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_MaskBuffer(), ids, Spec.model_validate({"mesh": {"tp": 2}}))
    plan = program.plan
    assert plan.fixed_sizes == () and not [w for w in program.warnings if "fixes" in w]
    guard = ("ids", 1, 16, "L['ids'].size()[1] != 32", {"ids": [4, 16]}, ((32, 32),))
    assert guard in plan.size_guards, plan.size_guards
    assert ParallelPlan.from_json(plan.to_json()).size_guards == plan.size_guards
    assert "- input 'ids': captured under `L['ids'].size()[1] != 32`, which the sequence " \
        "length 32 break(s) (of 2..256); run.py refuses a --seq-len that breaks it" \
        in program.report
    for seq in (8, 16, 31):
        check_fixed_sizes(plan, 8, seq, "--batch-size", "--seq-len")
    with pytest.raises(UserError, match=r"^--seq-len 32: torch\.export captured input 'ids' "
                                        r"under the condition `L\['ids'\]\.size\(\)\[1\] != 32` "
                                        r".*that break it: 32\).*use another sequence length"):
        check_fixed_sizes(plan, None, 32, "--batch-size", "--seq-len")


class _BlocksUpToLength(nn.Module):
    """Runs block ``i`` only while ``i < T`` (Python control flow on the length): export
    guards ``T > 2`` and ``T > 3`` at T = 8, a range of at least 4 with no op behind it.
    run.py's refusal of T = 2 explained it as "a position table sliced or looked up by it,
    an assert, which another size fails inside the forward", though nothing fails: the
    model takes another branch (zoo 24 F5)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(),
                                                  nn.Linear(2 * D, D)) for _ in range(4))

    def forward(self, ids):
        x = self.emb(ids)
        for i, block in enumerate(self.blocks):
            if i < ids.shape[1]:
                x = x + block(x)
        return x


def test_a_length_guarded_by_control_flow_is_refused_naming_the_guards():
    from parallelizer.errors import UserError
    from parallelizer.runtime.data_source import check_fixed_sizes

    torch.manual_seed(0)
    ids = (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)),)
    plan = compiler.compile_module(_BlocksUpToLength(), ids,
                                   Spec.model_validate({"mesh": {"tp": 2}})).plan
    assert ("ids", 1, 4, None, "") in plan.size_ranges, plan.size_ranges
    for seq in (4, 6, 64):
        check_fixed_sizes(plan, None, seq, "--batch-size", "--seq-len")
    with pytest.raises(UserError) as e:
        check_fixed_sizes(plan, None, 2, "--batch-size", "--seq-len")
    assert str(e.value) == (
        "--seq-len 2: torch.export captured input 'ids' under `L['ids'].size()[1] > 2`, "
        "`L['ids'].size()[1] > 3` on its sequence length, which 2 breaks: conditions the "
        "model's code sets (its Python control flow or an assert), and the program computes "
        "the model only where they hold (at least 4, each condition met; report.md lists "
        "them); use such a sequence length")
    with pytest.raises(UserError, match=r"^--seq-len 3: .* under `L\['ids'\]\.size\(\)\[1\] "
                                        r"> 3` on its sequence length, which 3 breaks"):
        check_fixed_sizes(plan, None, 3, "--batch-size", "--seq-len")


class _MaskInput(nn.Module):
    """An explicit (B, S, S) attention mask beside the token ids (torchtune's ``mask=``).
    Only dims 0 and 1 of an input were symbolic, so the mask's dim 2 was captured as the
    example's 16 and, unified with the length, pinned it: the compile warned that the code
    fixes the sequence length and blamed a ``view`` sized by the tensor (zoo 15 Z4)."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(64, D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, ids, mask):
        x = self.emb(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return x + self.out(y.transpose(1, 2).reshape(b, t, D))


def _ids_and_mask(batch: int, seq: int):
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return ids, torch.ones(batch, seq, seq, dtype=torch.bool).tril()


def test_a_mask_input_of_s_by_s_keeps_the_length_symbolic_and_runs_another():
    from parallelizer.runtime.batching import flatten
    from parallelizer.runtime.data_source import _resized
    from tp_check import assert_tp_matches, planned

    torch.manual_seed(0)
    model = _MaskInput()
    program = compiler.compile_module(model, _ids_and_mask(4, 16),
                                      Spec.model_validate({"mesh": {"tp": 2}}))
    assert program.plan.fixed_sizes == () and program.plan.sequence_dims == (("mask", 2),)
    assert not [w for w in program.warnings if "fixes" in w], program.warnings
    ids, mask = flatten(program.plan, _resized(program.plan, _ids_and_mask(4, 16), 8, 24))
    assert ids.shape == (8, 24) and mask.shape == (8, 24, 24)
    gm, decision = planned(model, _ids_and_mask(4, 16), 2)  # captured at 16, run at 24
    assert_tp_matches(model, _ids_and_mask(2, 24), 2, decision, gm)


def test_batches_of_another_length_are_refused_before_a_stage_runs():
    """run.py refused another --seq-len, but batches from model.py's batches() were not
    checked: a length the code fixes failed inside a stage's view on every rank (zoo 16 Z10,
    torchscale's chunkwise RetNet: "shape '[4, 4, 8, 64]' is invalid")."""
    from types import SimpleNamespace
    from parallelizer.errors import UserError
    from parallelizer.runtime.data_source import GlobalSource

    plan = _compile(False).plan
    ctx = SimpleNamespace(dp_rank=0, device=torch.device("cpu"))
    batches = iter([(torch.randn(4, 16, D),), (torch.randn(4, 8, D),)])
    source = GlobalSource(plan, batches, ctx)
    assert source.next_step(1)[0].shape == (4, 16, D)
    with pytest.raises(UserError, match=r"^model\.py's batches\(\): sequence length 8: the "
                                        r"program runs only the sequence length 16 of input "
                                        r"'x', which the model's code fixes"):
        source.next_step(1)


class _PerFeature(nn.Module):
    """FT-Transformer's numeric tokenizer: a weight per feature of a (batch, features) input
    fixes dim 1; no sequence, so no warning, and run.py's refusal of --seq-len pointed at a
    report.md that named nothing (zoo 17 Z1)."""

    def __init__(self):
        super().__init__()
        self.w, self.a, self.b = nn.Parameter(torch.randn(12, D)), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.b(self.a((x[..., None] * self.w).mean(1))).square().mean()


def test_a_fixed_dim_without_a_warning_is_named_in_the_report():
    from parallelizer.errors import UserError
    from parallelizer.runtime.data_source import check_fixed_sizes
    torch.manual_seed(0)
    program = compiler.compile_module(_PerFeature(), (torch.randn(8, 12),),
                                      Spec.model_validate({"mesh": {"tp": 2}}), reference=False)
    assert ("x", 1, 12) in program.plan.fixed_sizes
    assert not [w for w in program.warnings if "fixes" in w], program.warnings
    assert "- input 'x': dim 1 is 12 in every step, fixed by the model's code" in program.report
    with pytest.raises(UserError, match="report.md names it"):
        check_fixed_sizes(program.plan, None, 10, "--batch-size", "--seq-len")
