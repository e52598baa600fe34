"""The hints a capture refusal adds where the model's own settings are the cause
(frontend/capture_hints.py). A held-out zoo's HuBERT, Parakeet-CTC and a plain CTC model were
refused with the generic fix ("make the failing line traceable") at lines the user cannot
edit: transformers' ``labels.max() >= vocab_size`` check, SpecAugment's numpy masks, and
``aten._ctc_loss`` (an output shape that depends on the data). Each refusal now names the
setting and the fix, and the fix compiles."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.errors import CaptureError, PlanError
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec

T = pytest.importorskip("transformers")
MODEL = Path("model.py")


def _hubert(**overrides):
    torch.manual_seed(0)
    config = T.HubertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=4, intermediate_size=64, conv_dim=[16, 16],
                            conv_stride=[5, 4], conv_kernel=[10, 4], num_conv_pos_embeddings=8,
                            num_conv_pos_embedding_groups=4, mask_time_length=2,
                            layerdrop=0.0, **overrides)
    return T.HubertForCTC(config).train()


def _values(batch=2):
    return torch.randn(batch, 800, generator=torch.Generator().manual_seed(1))


def test_specaugment_names_its_config_keys_and_off_it_captures():
    with pytest.raises(CaptureError) as e:
        capture(_hubert(mask_time_prob=0.05), {"input_values": _values()}, MODEL)
    message = str(e.value)
    assert "The model's config sets SpecAugment (mask_time_prob=0.05)" in message, message
    assert "Set config.mask_time_prob = 0.0 in build_model()" in message, message
    assert "LayerDrop" not in message and "loss" not in message, message
    capture(_hubert(mask_time_prob=0.0), {"input_values": _values()}, MODEL)


def test_a_labels_check_in_forward_points_to_loss_fn():
    labels = torch.randint(1, 16, (2, 3), generator=torch.Generator().manual_seed(2))
    with pytest.raises(CaptureError) as e:
        capture(_hubert(mask_time_prob=0.0), {"input_values": _values(), "labels": labels}, MODEL)
    message = str(e.value)
    assert "modeling_hubert.py" in message and "labels.max()" in message, message
    assert ("The capture failed in the model's loss: leave labels out of example_inputs()"
            in message), message
    assert "loss_fn(outputs, batch)" in message and "SpecAugment" not in message, message


class _CTC(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Linear(8, 32), nn.Linear(32, 6)

    def logits(self, feats):
        return self.head(torch.tanh(self.enc(feats)))

    def forward(self, feats, targets=None):
        out = self.logits(feats)
        return out if targets is None else _ctc(out, targets)


def _ctc(logits, targets):
    b, t = logits.shape[:2]
    lp = logits.log_softmax(-1).transpose(0, 1)
    return F.ctc_loss(lp, targets, torch.full((b,), t, dtype=torch.long),
                      torch.full((b,), targets.shape[1], dtype=torch.long))


def test_a_loss_export_cannot_hold_points_to_loss_fn_and_there_it_compiles():
    gen = torch.Generator().manual_seed(0)
    feats, targets = torch.randn(4, 10, 8, generator=gen), torch.randint(1, 6, (4, 3), generator=gen)
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as e:
        capture(_CTC(), {"feats": feats, "targets": targets}, MODEL)
    message = str(e.value)
    assert "_ctc_loss" in message and "The capture failed in the model's loss" in message, message
    assert "loss_fn(outputs, batch)" in message, message
    program = compiler.compile_module(
        _CTC(), {"feats": feats}, Spec.model_validate({"mesh": {"tp": 2}}),
        loss_fn=lambda out, batch: _ctc(out, targets), reference=False)
    assert program.plan.tensors["enc.weight"].tp_dim is not None


class _MasksOnlyEagerly(nn.Module):
    """As transformers' LongT5 stack: a mask of ones made when none is given, except under
    ``torch.compiler.is_compiling()``; the mask-less branch is broken (a (1, ...) bias
    concatenated to a (batch, ...) one, LongT5's transient-global attention)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.proj(input_ids.float().unsqueeze(-1).expand(-1, -1, 4))
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones_like(input_ids)
        bias = torch.zeros(1, h.shape[1], 1) if attention_mask is None else \
            attention_mask[..., None].float()
        return torch.cat([bias, h], dim=-1)


def test_an_attention_mask_transformers_makes_only_eagerly_is_named(tmp_path):
    """The model runs as it is but fails under torch.export, which takes the mask-less
    branch; the refusal says to give the mask (a break test: LongT5 with it compiles and
    passes --verify at tp4)."""
    ids = torch.randint(0, 9, (2, 8))
    with pytest.raises(CaptureError, match=r"takes an attention_mask that example_inputs\(\) "
                                           r"does not give"):
        capture(_MasksOnlyEagerly(), {"input_ids": ids}, tmp_path / "model.py")
    capture(_MasksOnlyEagerly(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            tmp_path / "model.py")


class _AssertsOnIds(nn.Module):
    """Takes a mask it does not need and fails capture elsewhere: ProphetNet's shift of the
    labels asserts ``torch.all(ids >= 0).item()``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, attention_mask=None):
        assert torch.all(input_ids >= 0).item(), "ids must be >= 0"
        return self.proj(input_ids.float().unsqueeze(-1).expand(-1, -1, 4))


def test_the_mask_hint_is_given_only_where_a_mask_of_ones_captures():
    """ProphetNet, DBRX and Nystromformer got the hint to give attention_mask and failed the
    same way with it (zoo 14 F2, F3, F6); the hint is tried before it is given."""
    with pytest.raises(CaptureError) as e:
        capture(_AssertsOnIds(), {"input_ids": torch.randint(0, 9, (2, 8))}, Path("model.py"))
    assert "attention_mask" not in str(e.value), str(e.value)


class _LayerDrop(nn.Module):
    """A transformers-style encoder with LayerDrop (Wav2Vec2Encoder's loop)."""

    def __init__(self):
        super().__init__()
        from transformers import PretrainedConfig
        self.config = PretrainedConfig(layerdrop=0.1)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, input_values, attention_mask=None):
        for layer in self.layers:
            skip = False
            if self.training and self.config.layerdrop > 0.0:
                skip = torch.rand([]) < self.config.layerdrop
            if not skip:
                input_values = layer(input_values)
        return input_values


def test_layerdrop_refusal_names_the_config_key_and_no_mask_hint():
    """Wav2Vec2, WavLM, Data2VecAudio and NLLB-MoE as configured were refused at the layer
    loop's ``if`` with the generic fix and an attention_mask hint "of the input_ids' shape"
    for a model of input_values (a held-out zoo). Worse, this loop was captured by the
    symbolic_trace fallback, whose ``torch.rand([])`` ran once at trace time: the skip it drew
    would have held for every step. A trace that draws is refused now; the refusal names
    LayerDrop's config key and the fix, and the mask hint is for models given input_ids."""
    with pytest.raises(CaptureError) as e:
        capture(_LayerDrop(), {"input_values": torch.randn(2, 4)}, Path("model.py"))
    message = str(e.value)
    assert "The model's config sets LayerDrop (layerdrop=0.1)" in message, message
    assert "Set config.layerdrop = 0.0 in build_model()" in message, message
    assert "attention_mask" not in message, message


class _GradInForward(nn.Module):
    """A gradient computed inside forward by torch.func (titans-pytorch's neural memory)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        g = torch.func.vmap(torch.func.grad(lambda w, xi: (xi @ w).pow(2).sum()),
                            in_dims=(None, 0))(self.w, x)
        return self.fc(x) + (x.unsqueeze(-1) * g.unsqueeze(1)).sum(-1)


class _BranchOnValues(nn.Module):
    """ESM-2's ``if not padding_mask.any(): padding_mask = None``: a branch on the data."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not (x > 5).any():
            x = x * 2
        return self.fc(x)


def test_the_torch_func_hint_is_given_for_torch_func_only():
    """torch.func inside forward is named (titans' refusal said only "'Tensor' object has no
    attribute 'constant'", zoo 13 Z6); a branch on the data is not, though torch.export's own
    aot_autograd frames in torch/_functorch are on its stack too (ESM-2 got the hint, zoo 15)."""
    with pytest.raises(CaptureError) as e:
        capture(_GradInForward(), (torch.randn(2, 3, 4),), Path("model.py"))
    assert "The failure is inside torch.func (grad, vmap, jacrev) called by forward" \
        in str(e.value), str(e.value)
    with pytest.raises(CaptureError) as e:
        capture(_BranchOnValues(), (torch.randn(2, 3, 4),), Path("model.py"))
    assert "torch.func" not in str(e.value) and "data-dependent" in str(e.value), str(e.value)


def _line_of(code: str) -> int:
    """The line of this file holding ``code`` (a model's check a message must name)."""
    return next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if code in s)


class _OneHotIds(nn.Module):
    """enformer-pytorch's input handling (zoo 16 Z8): integer ids one-hot encoded behind an
    exact-type check, which a FakeTensor never passes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        if type(x) == torch.Tensor and x.dtype == torch.long:  # noqa: E721  the model's check
            x = F.one_hot(x, num_classes=4).float()
        return self.fc(x)


def test_an_exact_type_check_is_named_and_torchs_kernel_logs_stay_quiet(caplog):
    ids = torch.randint(0, 4, (2, 5), generator=torch.Generator().manual_seed(0))
    _OneHotIds()(ids)  # the model runs as it is
    with pytest.raises(CaptureError) as e:
        capture(_OneHotIds(), (ids,), MODEL)
    line = _line_of("if type(x) == torch.Tensor")
    assert f"checks a tensor's exact type at test_capture_hints.py:{line} (if type(x) == " \
           f"torch.Tensor" in str(e.value), e.value
    assert not [r for r in caplog.records if r.name == "torch._subclasses.fake_tensor"], \
        "a failed export's meta-kernel tracebacks reached the log (114 lines before the refusal)"


class _ScaledIfExact(nn.Module):
    """An exact-type check guarding an op that changes no shape or dtype: the capture takes
    the other path with no error."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        if type(x) is torch.Tensor:  # the model's check
            x = x * 2.0
        return self.b(torch.relu(self.a(x)))


def _scaled_line() -> int:
    return _line_of("if type(x) is torch.Tensor")


def test_an_exact_type_check_is_warned_where_no_self_check_compares_the_program():
    program = compiler.compile_module(_ScaledIfExact(), (torch.randn(4, 3, 8),),
                                      Spec.model_validate({"mesh": {"dp": 2}}), reference=False)
    assert any(f"checks a tensor's exact type at test_capture_hints.py:{_scaled_line()}" in w
               and "did not run" in w for w in program.warnings), program.warnings


def test_a_self_check_failing_on_an_exact_type_check_names_it_not_a_bug():
    with pytest.raises(PlanError, match=rf"Likelier than a bug: the model checks a tensor's "
                                        rf"exact type at test_capture_hints.py:{_scaled_line()}"):
        compiler.compile_module(_ScaledIfExact(), (torch.randn(4, 3, 8),),
                                Spec.model_validate({"mesh": {"tp": 2}}), reference=False)


def test_the_warning_gives_the_skipped_self_checks_reason_whole():
    """The reason comes from the self-check's decision, not from its note cut at the first
    parenthesis (a reason ending in a parenthesis of its own lost it; a size limit's came
    with the note's own "--self-check forces it" before the warning's same hint)."""
    program = compiler.compile_module(
        _ScaledIfExact(), (torch.randn(4, 3, 8),),
        Spec.model_validate({"mesh": {"tp": 2}, "self_check": {"max_params": 10}}),
        reference=False)
    params = sum(p.numel() for p in _ScaledIfExact().parameters())
    (warning,) = [w for w in program.warnings if "exact type" in w]
    assert f"did not run ({params:,} parameters > self_check.max_params (10)); " in warning, \
        warning


class _CausalDecoder(nn.Module):
    """torch's decoder given a causal tgt_mask without tgt_is_causal (zoo 18 Z7)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 2)

    def forward(self, tgt, memory):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.dec(tgt, memory, tgt_mask=mask)


def test_torchs_causal_mask_test_is_named_with_its_flag():
    batch = (torch.randn(2, 5, 16), torch.randn(2, 7, 16))
    with pytest.raises(CaptureError, match=r"(?s)transformer\.py:\d+.*tests whether the mask you "
                                           r"pass is causal by reading its values.*"
                                           r"tgt_is_causal=True"):
        capture(_CausalDecoder(), batch, Path(__file__))


def test_sizes_fixed_under_as_example_are_not_blamed_on_the_models_code():
    """Following the general hint, the same decoder captures under as_example, but
    draft_export held batch and sequence at the example's; the refusal at pp2 said "the
    model's code fixes the batch size" and sent the user to code that fixes nothing."""
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2},
                                "capture": {"data_dependent_branches": "as_example"}})
    with pytest.raises(PlanError, match=r"^the capture under capture\.data_dependent_branches="
                                        r"as_example fixes the batch size at the example's 4: "
                                        r"torch\.export\.draft_export"):
        compiler.compile_module(_CausalDecoder(), (torch.randn(4, 5, 16), torch.randn(4, 7, 16)),
                                spec, reference=False)
