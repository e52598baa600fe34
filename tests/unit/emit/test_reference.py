"""The reference step's loss over the program's row chunks (emit/reference.py): a loss that
is a mean over samples gives the whole batch's loss back, one over batch statistics does not,
and the compile says so instead of leaving run.py --verify to FAIL unexplained."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer.compiler import compile_model
from parallelizer.emit.reference import chunked_step, compute_reference, sample_mean_warnings
from parallelizer.frontend.spec import load_spec

MODELS = Path(__file__).resolve().parents[2] / "distributed" / "user_models"
SPEC = MODELS / "spec.yaml"


def _mse(out, batch):
    return F.mse_loss(out, torch.zeros_like(out))


def _batch():
    return (torch.randn(8, 6, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("norm, separable", [(nn.LayerNorm, True), (nn.BatchNorm1d, False)])
def test_loss_over_chunks_is_the_whole_batch_loss_only_for_a_mean_over_samples(norm, separable):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), norm(6), nn.Linear(6, 3)).train()
    spec = load_spec(SPEC, ["mesh.dp=2", "pipeline.microbatches=2"])
    ref = compute_reference(model, _batch(), _mse, ["x"], spec)
    chunked = ref["loss.chunked"]
    assert chunked.shape == () and torch.isclose(chunked, ref["loss"]) == separable
    warnings = sample_mean_warnings(ref, spec)
    if separable:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(
            "the loss is not a mean over samples: on the batch cut into mesh.dp (2) x "
            "pipeline.microbatches (2) chunks") and f"averages to {chunked.item():.6f}" in warnings[0]
        # the chunks' forwards put BatchNorm's running statistics back: only the reference
        # step's own forward moved them
        torch.manual_seed(0)
        again = nn.Sequential(nn.Linear(6, 6), norm(6), nn.Linear(6, 3)).train()
        again(_batch()[0])
        assert torch.equal(model[1].running_mean, again[1].running_mean)


class _RunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("rm", torch.zeros(3))

    def forward(self, x):
        h = self.lin(x)
        self.rm.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h - self.rm


def test_the_chunks_start_from_the_buffers_before_the_step():
    """The chunks ran after the whole batch's forward had written the running mean: the
    chunked loss came from another state than the program's microbatches start from, and
    verify called a correct pp program "something else" (zoo 22 F2, decision 226)."""
    torch.manual_seed(0)
    model = _RunningMean()
    fresh = copy.deepcopy(model)
    spec = load_spec(SPEC, ["mesh.dp=2"])
    ref = compute_reference(model, _batch(), _mse, ["x"], spec)
    n = spec.mesh.dp * spec.pipeline.microbatches
    want = sum(_mse(fresh(chunk), None) for chunk in _batch()[0].chunk(n)) / n
    torch.testing.assert_close(ref["loss.chunked"], want.detach(), rtol=0, atol=0)


def test_the_buffers_the_forward_writes_are_kept_as_after_the_step():
    """``buffer.FQN`` for BatchNorm's running statistics and count, as the forward left them
    (run.py --verify compares them); none for a buffer no forward writes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).train()
    model.register_buffer("scale", torch.ones(3))
    eager = nn.BatchNorm1d(6).train()
    eager(model[0](_batch()[0]))
    ref = compute_reference(model, _batch(), _mse, ["x"], load_spec(SPEC, []))
    assert {k for k in ref if k.startswith("buffer.")} == {
        "buffer.1.running_mean", "buffer.1.running_var", "buffer.1.num_batches_tracked"}
    torch.testing.assert_close(ref["buffer.1.running_mean"], eager.running_mean.detach())
    assert int(ref["buffer.1.num_batches_tracked"]) == 1


def test_one_chunk_or_rows_it_does_not_split_give_no_chunked_loss():
    model = nn.Linear(6, 3)
    assert chunked_step(model, _batch(), _mse, 1) is None
    assert chunked_step(model, _batch(), _mse, 3) is None


def test_router_auxiliary_loss_under_dp_is_a_compile_warning():
    """Mixtral returning its load-balancing loss (transformers' own): the mean of the loss over
    the dp x microbatch chunks is not the whole batch's; the compile warns, naming both."""
    program = compile_model(MODELS / "mixtral_aux.py", load_spec(SPEC, ["mesh.dp=2"]))
    text = "\n".join(program.warnings)
    assert "the loss is not a mean over samples: on the batch cut into mesh.dp (2) x " \
           "pipeline.microbatches (2) chunks" in text, program.warnings
    assert "Verify the layout at mesh.dp=1 mesh.pp=1 pipeline.microbatches=1 (tp alone; a " \
           "pipeline needs pipeline.microbatches >= mesh.pp)" in text


def _normed_square(out, batch):
    return out.pow(2).mean()


def test_the_reference_carries_the_models_own_rounding_error():
    """``noise.KEY``: each tensor's fp32 step against the same step in float64. Tiny beside a
    gradient the loss depends on; the whole gradient where the loss does not depend on the
    weights (a mean square of LayerNorm's output without affine: 1 whatever they are), and
    bf16's 8 bits for a bf16 model."""
    torch.manual_seed(0)
    spec = load_spec(SPEC, [])
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)).train()
    ref = compute_reference(model, _batch(), _mse, ["x"], spec)
    for key in ("loss", "output.0", "grad.0.weight", "param.1.bias"):
        assert ref[f"noise.{key}"].shape == () and ref[f"noise.{key}"] <= 1e-6 * ref[key].abs().max(), key
    flat = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6, eps=1e-12, elementwise_affine=False)).train()
    ref = compute_reference(flat, _batch(), _normed_square, ["x"], spec)
    assert ref["noise.grad.0.weight"] >= 0.1 * ref["grad.0.weight"].abs().max() > 0
    half = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)).to(torch.bfloat16).train()
    ref = compute_reference(half, tuple(t.to(torch.bfloat16) for t in _batch()), _mse, ["x"], spec)
    assert ref["noise.grad.0.weight"] >= 1e-4 * ref["grad.0.weight"].float().abs().max()


class _MaskedMHA(nn.Module):
    """nn.MultiheadAttention given a float32 causal mask, as tutorials write it: its float64
    copy meets the float32 mask and computes another function (outputs off by ~1, zoo 25
    F2), whose difference counted as the model's rounding error allowed a quarter of every
    gradient, and --verify said PASS."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_a_float64_copy_computing_another_function_gives_no_rounding_allowance():
    from parallelizer.emit.numerics_check import _with_rounding, reference
    torch.manual_seed(0)
    x = (torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0)),)  # 6 rows agree
    ref = compute_reference(_MaskedMHA(), x, _mse, ["x"], load_spec(SPEC, []))
    assert not any(k.startswith("noise.") for k in ref), sorted(ref)
    assert abs(float(ref["fp64.loss"]) - float(ref["loss"])) > 1e-4 * float(ref["loss"])
    model = _MaskedMHA()
    assert _with_rounding(model, x, reference(model, x), 0) is None  # the self-check's


class _ReluWrittenInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h.add_(1.0)  # autograd needs relu's output: the model's own backward fails
        return self.b(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_whose_own_backward_fails_is_the_users_error(dtype):
    """The self-check named it for an fp32 model; a bf16 one reached the reference step,
    whose backward raised torch's RuntimeError with a traceback, exit 1 (zoo 25 F1)."""
    from parallelizer.errors import CaptureError
    model = _ReluWrittenInPlace().to(dtype)
    with pytest.raises(CaptureError, match=r"fails on example_inputs\(\) when it runs as it is, "
                                           r"without parallelizer: RuntimeError: one of the "
                                           r"variables needed for gradient computation"):
        compute_reference(model, tuple(t.to(dtype) for t in _batch()), _mse, ["x"],
                          load_spec(SPEC, []))


def test_no_rounding_estimate_for_a_model_above_the_size_limit(monkeypatch):
    import parallelizer.emit.reference as reference
    monkeypatch.setattr(reference, "NOISE_MAX_PARAMETERS", 10)
    ref = compute_reference(nn.Linear(6, 3), _batch(), _mse, ["x"], load_spec(SPEC, []))
    assert "grad.weight" in ref and not any(k.startswith("noise.") for k in ref)


def test_run_time_chunk_line_compares_the_fp32_losses_at_fp32_tolerances():
    """run.py --verify's line after a FAIL: the chunked and whole-batch losses are both the
    fp32 model's, so chunk losses 0.1 % apart (a BatchNorm's per-chunk statistics, a break
    test's Conformer at dp2) are named even when the program runs bf16, whose tolerances
    (3e-2) had called the loss a mean over samples."""
    from parallelizer.runtime.verify import chunks_line, tolerances
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).train()
    ref = compute_reference(model, _batch(), _mse, ["x"], load_spec(SPEC, ["mesh.dp=2"]))
    vcfg = {"atol": 1e-5, "rtol": 1e-5}
    ref["loss.chunked"] = ref["loss"] * 1.001
    atol, rtol = tolerances(vcfg, "bf16")
    assert torch.allclose(ref["loss.chunked"], ref["loss"], atol=atol, rtol=rtol)
    assert chunks_line(ref, 2, 1, vcfg).startswith(
        "the loss is not a mean over samples: on the batch cut into mesh.dp (2) x "
        "pipeline.microbatches (1) chunks")
    # the program's loss is the chunks' loss: the chunking explains it
    assert chunks_line(ref, 2, 1, vcfg, ref["loss.chunked"].clone()).startswith(
        "the loss is not a mean over samples")
    # ... or it is neither (zoo 10's capacity baked from the whole batch): said first
    other = ref["loss"] * 0.99
    assert chunks_line(ref, 2, 1, vcfg, other).startswith(
        f"the program's loss {other.item():.6f} is not the unmodified model's on the same "
        f"chunks either ({ref['loss.chunked'].item():.6f}), so the chunking does not explain")
    ref["loss.chunked"] = ref["loss"].clone()
    assert any(k.startswith("chunked.grad.") for k in ref)  # batch statistics: gradients too
    assert chunks_line(ref, 2, 1, vcfg).startswith("its gradients are not a mean over samples")
    ref = {k: v for k, v in ref.items() if not k.startswith("chunked.")}
    assert chunks_line(ref, 2, 1, vcfg).endswith("so the loss is a mean over samples")


class _KeepsState(nn.Module):
    """Keeps a tensor of its forward as a plain attribute (RecurrentGemma's RG-LRU keeps
    ``recurrent_states`` so, use_cache or not)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        self.state = None

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        self.state = h[:, -1]
        return x + self.fc2(h)


def test_a_model_holding_a_tensor_of_its_last_forward_compiles_with_its_reference():
    """deepcopy refuses a tensor that is no graph leaf: the compile crashed in the reference
    step's float64 copy (a break test); such tensors are copied detached."""
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    model = _KeepsState()
    model(*_batch())  # the model as a user may hand it over: after a forward
    assert not model.state.is_leaf
    program = compiler.compile_module(model, _batch(), Spec.model_validate({"mesh": {"tp": 2}}),
                                      loss_fn=_mse)
    assert "noise.loss" in program.reference and "grad.fc1.weight" in program.reference


def _half(t):
    return t * 0.5


class _HoldsStaticmethod(nn.Module):
    """simple-hierarchical-transformer 0.4 keeps ``self.apply_rotary_emb =
    staticmethod(apply_rotary_emb)``, which deepcopy refuses ("cannot pickle 'staticmethod'
    object"): the compile died in the reference step's copy with a raw traceback (zoo 13
    Z11). Such an attribute is shared with the copy."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        self.fn = staticmethod(_half)

    def forward(self, x):
        return x + self.fc2(self.fn.__func__(torch.relu(self.fc1(x))))


def test_a_module_holding_what_deepcopy_refuses_compiles_with_its_reference():
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    model = _HoldsStaticmethod()
    program = compiler.compile_module(model, _batch(), Spec.model_validate({"mesh": {"tp": 2}}),
                                      loss_fn=_mse)
    assert "noise.loss" in program.reference and "grad.fc1.weight" in program.reference
    assert isinstance(model.fn, staticmethod)


class _SparseBuffer(nn.Module):
    """openai-whisper registers ``alignment_heads`` as a sparse bool buffer forward never
    reads: comparing buffers around the reference step raised "Could not run 'aten::equal'
    with arguments from the 'SparseCPU' backend", reported as the model failing as it is
    (zoo 13 Z4)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        heads = torch.zeros(2, 4, dtype=torch.bool)
        heads[1, 2:] = True
        self.register_buffer("alignment_heads", heads.to_sparse(), persistent=False)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_a_sparse_buffer_compiles_with_its_reference():
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    program = compiler.compile_module(_SparseBuffer(), _batch(),
                                      Spec.model_validate({"mesh": {"tp": 2}}), loss_fn=_mse)
    assert "grad.fc1.weight" in program.reference
    assert not any(k.startswith("buffer.") for k in program.reference)


_CARRIES_STATE = """
import torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        self.state = None

    def forward(self, x):  # reads back, in the next call, what the last call kept
        h = torch.relu(self.fc1(x))
        if self.state is not None:
            h = h + self.state[:, None]
        self.state = h[:, -1]
        return x + self.fc2(h)

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())

def example_inputs():
    return (torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0)),)
"""


def test_a_model_carrying_state_across_calls_is_refused_naming_it(tmp_path):
    """The compile crashed with torch's "backward through the graph a second time" traceback
    in the reference step (a break test); it is refused, naming the attributes."""
    from parallelizer.errors import CaptureError
    (tmp_path / "model.py").write_text(_CARRIES_STATE)
    with pytest.raises(CaptureError, match=r"carries tensors from one forward to the next: "
                                           r"0.state, 1.state hold values of an earlier call"):
        compile_model(tmp_path / "model.py", load_spec(SPEC, ["mesh.tp=2"]))


class _FailsOnlyEagerly(nn.Module):
    """Traced fine, refused by the eager kernel (transformers' grouped_mm on GPT-OSS with an
    expert width whose rows are not 16-byte aligned: a fallback under export, torch's
    ``_grouped_mm`` eagerly)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x):
        if not torch.compiler.is_compiling():
            raise RuntimeError("strides should be multiple of 16 bytes")
        return x + self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("self_check", [True, False])
def test_a_model_failing_as_it_is_after_capture_is_a_clear_error(self_check):
    """The self-check's (or the reference step's) run of the model raised torch's traceback
    from inside the compile (a break test); it is the model's own failure, said as capture
    says it."""
    from parallelizer import compiler
    from parallelizer.errors import CaptureError
    from parallelizer.frontend.spec import Spec
    spec = Spec.model_validate({"mesh": {"tp": 2}, "self_check": {"mode": self_check}})
    with pytest.raises(CaptureError, match=r"fails on example_inputs\(\) when it runs as it is, "
                                           r"without parallelizer: RuntimeError: strides should"):
        compiler.compile_module(_FailsOnlyEagerly(), _batch(), spec, loss_fn=_mse)


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 5)

    def forward(self, x, labels):
        return self.head(x)


def test_a_token_mean_with_unevenly_ignored_labels_is_named():
    """A cross-entropy averaged over the labels not ignored (-100), with the ignored ones
    spread unevenly over the chunks, is no mean over samples (a break test's padded Helium at
    tp2 x pp2): the warning names that cause."""
    torch.manual_seed(0)
    labels = torch.tensor([0, 1, -100, -100, -100, 2, 3, 4])
    batch = (_batch()[0], labels)
    spec = load_spec(SPEC, ["mesh.dp=2", "pipeline.microbatches=1"])
    ref = compute_reference(_Logits(), batch, lambda out, b: F.cross_entropy(out, b[1]),
                            ["x", "labels"], spec)
    (warning,) = sample_mean_warnings(ref, spec)
    assert "a mean over tokens with ignored labels (-100) spread unevenly" in warning, warning


class _AuxLoss(nn.Module):
    """A mean square plus 1e-4 x a load-balancing term over the batch's mean routing
    probabilities (not linear in the samples): the chunks' loss stays within 1e-5 of the
    whole batch's, the router's gradient, which only that term reaches, does not."""

    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(6, 6), nn.Linear(6, 4, bias=False)

    def forward(self, x):
        importance = self.gate(x).softmax(-1).mean(0)
        return self.fc(x).pow(2).mean() + 1e-4 * 4 * (importance * importance).sum()


def test_a_gradient_the_chunks_change_is_a_compile_warning_when_the_loss_agrees():
    """A held-out zoo's router-style auxiliary loss at pp2 x 2 microbatches: no warning, and
    --verify FAILed on the router's gradient while saying "the loss is a mean over samples"."""
    from parallelizer.runtime.verify import chunks_line
    torch.manual_seed(0)
    spec = load_spec(SPEC, ["mesh.dp=2"])
    batch = (torch.randn(8, 6, generator=torch.Generator().manual_seed(0)) * 10,)
    ref = compute_reference(_AuxLoss(), batch, lambda out, b: out, ["x"], spec)
    assert torch.allclose(ref["loss.chunked"], ref["loss"], atol=1e-5, rtol=1e-5)
    assert [k for k in ref if k.startswith("chunked.")] == ["chunked.grad.gate.weight"]
    warnings = sample_mean_warnings(ref, spec)
    assert len(warnings) == 1 and "; the gradient of gate.weight differs from the whole " \
                                  "batch's by up to" in warnings[0], warnings
    assert chunks_line(ref, 2, 2, {"atol": 1e-5, "rtol": 1e-5}) == warnings[0]
    # a mean over samples: neither
    ref = compute_reference(nn.Linear(6, 3), batch, _mse, ["x"], spec)
    assert sample_mean_warnings(ref, spec) == [] and not any(k.startswith("chunked.") for k in ref)


class _TokenMean(nn.Module):
    """A token-mean cross-entropy over labels other than -100, after an optional BatchNorm."""

    def __init__(self, norm):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(6, 6), norm, nn.Linear(6, 5)

    def forward(self, x, labels):
        return F.cross_entropy(self.out(self.norm(self.fc(x))), labels, ignore_index=-100)


def test_a_whole_step_token_mean_weighs_the_chunks_by_their_counts():
    """The program divides a token mean by the whole step's count (decision 95), so the
    compile skipped the chunk check for it, and a BatchNorm beside it (Wav2Vec2-Conformer's
    convolution module, a held-out zoo at pp2) FAILed --verify unwarned. The chunks are now
    weighed by their share of the count: ignored labels spread unevenly agree, batch
    statistics still do not."""
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    labels[:3] = -100  # 1 counted token in the first chunk, 4 in the second
    spec = load_spec(SPEC, ["mesh.dp=2", "pipeline.microbatches=1"])
    count = lambda x, labels: [(labels != -100).sum()]  # noqa: E731  the plan's counter
    for norm, warned in ((nn.Identity(), False), (nn.BatchNorm1d(6), True)):
        torch.manual_seed(0)
        ref = compute_reference(_TokenMean(norm).train(), (x, labels), lambda out, b: out,
                                ["x", "labels"], spec, count=count)
        assert bool(sample_mean_warnings(ref, spec)) == warned, norm
    torch.manual_seed(0)  # unweighed, the uneven counts alone looked like a coupling
    ref = compute_reference(_TokenMean(nn.Identity()), (x, labels), lambda out, b: out,
                            ["x", "labels"], spec)
    assert sample_mean_warnings(ref, spec)


class _Fp32Norm(torch.nn.Module):
    """torchtune's RMSNorm: computes in fp32 whatever its weight's dtype."""

    def __init__(self, d=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), self.scale).type_as(x)


def test_the_float64_estimate_does_not_warn_for_the_model():
    """The rounding estimate's float64 step of a model that casts to fp32 made torch warn
    "Mismatch dtype between input and weight" on every compile of a torchtune model (zoo 11
    N1): a warning about our estimate, not the user's model, which its fp32 step ran."""
    import warnings
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(_Fp32Norm(), torch.nn.Linear(8, 8)) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        program = compiler.compile_module(Net(), (torch.randn(2, 3, 8),), Spec.model_validate({}))
    assert not [w for w in seen if "Mismatch dtype" in str(w.message)], \
        [str(w.message) for w in seen]
    assert any(k.startswith("noise.") for k in program.reference), sorted(program.reference)[:5]


class _InBatchContrastive(nn.Module):
    """CLIP's and CoCa's in-batch contrastive loss inside forward: each sample's logits are
    its similarities to the batch's other samples, its label its own index."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, y):
        sim = self.a(x) @ self.b(y).t()
        labels = torch.arange(x.shape[0])
        return (F.cross_entropy(sim, labels) + F.cross_entropy(sim.t(), labels)) * 0.5


def test_an_in_batch_contrastive_loss_is_warned_though_its_two_token_means_are_exact():
    """Two token means (the symmetric cross-entropies) skipped the chunk check, which weighed
    chunks by one site's count only: CoCa at pp2 trained another loss unwarned (zoo 12 F7).
    Sites that weigh the chunks alike are weighed so; this loss then is no mean over
    samples, and the compile says so."""
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))
    torch.manual_seed(0)
    program = compile_module(_InBatchContrastive(), batch,
                             Spec.model_validate({"pipeline": {"microbatches": 2}}))
    assert program.plan.token_means and len(program.plan.token_means["sites"]) == 2
    assert any(w.startswith("the loss is not a mean over samples: on the batch cut into "
                            "mesh.dp (1) x pipeline.microbatches (2) chunks")
               for w in program.warnings), program.warnings


def test_token_means_weighing_the_chunks_differently_give_no_chunked_loss():
    spec = load_spec(SPEC, ["mesh.dp=2", "pipeline.microbatches=1"])
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    alike = lambda x, labels: [(labels >= 0).sum(), 2 * (labels >= 0).sum()]  # noqa: E731
    unlike = lambda x, labels: [(labels >= 0).sum(), (labels > 1).sum()]  # noqa: E731
    for count, chunked in ((alike, True), (unlike, False)):
        torch.manual_seed(0)
        ref = compute_reference(_TokenMean(nn.Identity()), (x, labels), lambda out, b: out,
                                ["x", "labels"], spec, count=count)
        assert ("loss.chunked" in ref) is chunked, count



class _ScaledEmbedding(nn.Module):
    """nn.Embedding(scale_grad_by_freq=True) under a loss that is a mean over samples (zoo 18
    Z8): the chunks' losses equal the whole batch's, the embedding's gradient does not."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_a_scale_grad_by_freq_embedding_is_named_and_the_loss_not_blamed():
    torch.manual_seed(0)
    model = _ScaledEmbedding()
    spec = load_spec(SPEC, ["mesh.dp=2", "pipeline.microbatches=2"])
    ids = (torch.tensor([[1, 1, 2], [1, 3, 3], [4, 1, 5], [6, 6, 6]] * 2),)
    ref = compute_reference(model, ids, _mse, ["ids"], spec, chunks=True)
    (warning,) = sample_mean_warnings(ref, spec, model)
    assert warning.startswith("its gradients are not a mean over samples"), warning
    assert warning.endswith("emb has scale_grad_by_freq=True: each row's gradient is divided by "
                            "its token's count in the chunk, not in the whole batch"), warning


class _Uncopyable(nn.Module):
    """A model whose ``__deepcopy__`` cannot rebuild it (keras 3's serialises through its
    registry of classes: an unregistered class raised a raw traceback, zoo 18 Z5)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x)

    def __deepcopy__(self, memo):
        raise TypeError("Could not locate class '_Uncopyable'")


def test_a_model_deepcopy_cannot_copy_is_a_clear_error():
    from parallelizer.emit.reference import copy_model
    from parallelizer.errors import ModelFileError
    with pytest.raises(ModelFileError, match=r"cannot be copied with copy\.deepcopy \(TypeError: "
                                             r"Could not locate class '_Uncopyable'\); the "
                                             r"compile runs copies"):
        copy_model(_Uncopyable())
