"""Hints added to a capture refusal (frontend/capture.py) where the model's own settings
are the cause: a branch or a host computation that no graph can hold, which a setting of the
model or of model.py removes. Each names the setting and the fix; none changes the model."""
from __future__ import annotations

import inspect
import os
import re
import traceback
from pathlib import Path
from typing import Callable

import torch

from .branches import SPEC_KEY, is_data_dependent
from .model_file import user_frame
from .source_lines import in_torch, shown_path


def hints(model: torch.nn.Module, args, kwargs, error: Exception, model_file: Path,
          captures: Callable[[tuple, dict], bool]) -> str:
    """Every hint that applies, each on its own line (or ""). ``captures(args, kwargs)``:
    the capture succeeds on those inputs (a hint that changes the inputs is tried first)."""
    return (setting_hints(model) + loss_hint(args, kwargs, error, model_file)
            + mask_hint(model, args, kwargs, captures) + functorch_hint(error)
            + causal_mask_hint(error) + branches_hint(error) + exact_type_hint(error))


def causal_mask_hint(error: Exception) -> str:
    """A hint when torch's own ``nn.Transformer`` / ``TransformerDecoder`` / ``Encoder``
    stopped the capture testing whether a given mask is causal
    (``_detect_is_causal_mask``: ``bool((mask == causal_comparison).all())``, a branch on the
    mask's values; zoo 18 Z7). Saying so with the flag skips the test; ``as_example``, the
    general hint, also captured it but fixed the batch and sequence at the example's."""
    frames = traceback.extract_tb(error.__traceback__)
    if not any(f.name == "_detect_is_causal_mask" and in_torch(f.filename) for f in frames):
        return ""
    return ("\ntorch's nn.Transformer tests whether the mask you pass is causal by reading its "
            "values; with a causal mask, say so and it does not: tgt_is_causal=True "
            "(nn.Transformer, nn.TransformerDecoder), is_causal=True (nn.TransformerEncoder, "
            "the layers' forward), src_is_causal=True / memory_is_causal=True likewise.")


def branches_hint(error: Exception) -> str:
    """A hint when a branch on a tensor's values stopped the capture: the spec key that takes
    the branch the example batch takes (:mod:`.branches`)."""
    if not is_data_dependent(error):
        return ""
    return (f"\nWhere the branch is one your data always takes the same way (a padding test "
            f"over batches that all have padding, or none), {SPEC_KEY}=as_example captures "
            f"the branch the example batch takes; a step taking the other then stops with "
            f"an error naming the line.")


def exact_type_hint(error: Exception) -> str:
    """A hint when a function on the failing call path checks a tensor's exact type
    (``type(x) == torch.Tensor``, ``type(x) is torch.Tensor``): under torch.export every
    tensor is a subclass (FakeTensor), the check is False where the model's own run finds it
    True, and the capture takes another path than the model. enformer-pytorch one-hot encodes
    integer ids behind ``type(x) == torch.Tensor and x.dtype == torch.long``; captured, the ids
    reached a conv, and the refusal blamed data-dependent control flow (zoo 16 Z8)."""
    checks = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not in_torch(code.co_filename):
            checks += _exact_type_checks(code)
        tb = tb.tb_next
    if not checks:
        return ""
    return (f"\nThe model checks a tensor's exact type at {'; '.join(dict.fromkeys(checks))}: "
            f"under torch.export every tensor is a subclass (FakeTensor), so that check is False "
            f"where the model's own run finds it True, and the capture takes another path than "
            f"the model. isinstance(x, torch.Tensor) is what such a check means.")


_EXACT_TYPE = re.compile(r"\btype\(\s*[\w.\[\]]+\s*\)\s*(==|is)\s*torch\.Tensor\b")


def _exact_type_checks(code) -> list[str]:
    """``file:line (source)`` of each exact-type check of a tensor in ``code``'s function."""
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return []
    return [f"{shown_path(code.co_filename)}:{first + i} ({line.strip()})"
            for i, line in enumerate(lines) if _EXACT_TYPE.search(line)]


def exact_type_sites(model: torch.nn.Module) -> list[str]:
    """``file:line (source)`` of each exact-type check of a tensor (:func:`exact_type_hint`)
    in the ``forward`` of a module class of ``model`` outside torch: where the other path does
    not fail, the capture takes it with no error (``if type(x) == torch.Tensor: x = x *
    scale``), and only the numerics self-check tells the program from the model."""
    sites: list = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is not None and not in_torch(code.co_filename):
            sites += _exact_type_checks(code)
    return list(dict.fromkeys(sites))


def setting_hints(model: torch.nn.Module) -> str:
    """The hints naming a setting of the model's config that draws in training (LayerDrop,
    SpecAugment), each on its own line (or "")."""
    return layerdrop_hint(model) + specaugment_hint(model)


def functorch_hint(error: Exception) -> str:
    """A hint when the failure is inside ``torch.func`` (``grad``, ``vmap``, ``jacrev``)
    called by forward: a gradient computed inside the forward (titans-pytorch's neural
    memory learns at test time by ``vmap(grad(loss))``) is no op of a training graph
    torch.export records, and the refusal said only "'Tensor' object has no attribute
    'constant'" (zoo 13 Z6). torch.export's own frames in ``torch/_functorch``
    (aot_autograd) are on every capture's stack and do not count: ESM-2's data-dependent
    ``if not padding_mask.any()`` got this hint (zoo 15)."""
    if not any(_in_torch_func(f.filename) for f in traceback.extract_tb(error.__traceback__)):
        return ""
    return ("\nThe failure is inside torch.func (grad, vmap, jacrev) called by forward: a "
            "gradient computed inside forward (test-time training, a neural memory's update) "
            "cannot be captured into the training graph; configure the model without it (a "
            "plain memory, no inner update) to compile the rest.")


# torch.func's transforms: torch/func re-exports the ones in these files of torch/_functorch,
# whose other files (aot_autograd) are torch.export's own machinery, on every export's stack
_TRANSFORMS = ("apis.py", "vmap.py", "eager_transforms.py")


def _in_torch_func(filename: str) -> bool:
    """``filename`` is code of ``torch.func``'s transforms (grad, vmap, jacrev)."""
    parts = os.path.normpath(filename).split(os.sep)
    for i in range(len(parts) - 1):
        if parts[i] == "torch" and (parts[i + 1] == "func" or parts[i + 1] == "_functorch"
                                    and parts[-1] in _TRANSFORMS and i + 2 == len(parts) - 1):
            return True
    return False


def mask_hint(model: torch.nn.Module, args, kwargs,
              captures: Callable[[tuple, dict], bool]) -> str:
    """A hint when forward takes an ``attention_mask`` the example leaves out and the capture
    succeeds with one of ones: transformers fills one in when it runs as it is but not under
    torch.export (``torch.compiler.is_compiling()``), so the traced model takes a branch its
    eager run never does (LongT5's transient-global attention then fails at a ``torch.cat``;
    a break test). Tried, not assumed: ProphetNet, DBRX and Nystromformer fail elsewhere and
    got the hint anyway (zoo 14 F2, F3, F6)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ""
    names = list(params)
    given = dict(zip(names, args)) | dict(kwargs)
    # a model of input_values / pixel_values makes no mask from them (WavLM: a zoo's noise)
    ids = given.get("input_ids")
    if "attention_mask" not in params or "attention_mask" in given or \
            not isinstance(ids, torch.Tensor):
        return ""
    if not captures(args, dict(kwargs, attention_mask=torch.ones_like(ids))):
        return ""
    return ("\nThe model's forward takes an attention_mask that example_inputs() does not give, "
            "and with one of ones the capture succeeds: transformers makes one when the model "
            "runs as it is, not under torch.export, so the captured code takes a branch its "
            "eager run never does. Give it in example_inputs() (ones of the input_ids' shape "
            "for no padding).")


def layerdrop_hint(model: torch.nn.Module) -> str:
    """A hint when a transformers config of the model sets LayerDrop (``layerdrop``,
    ``encoder_layerdrop``, ``decoder_layerdrop`` > 0, Fan et al. 2019): in training each
    layer draws a random number and Python skips the layer on it, a branch on a tensor's
    value no graph holds (Wav2Vec2, WavLM, Data2VecAudio, NLLB-MoE in a held-out zoo, refused
    at the ``if`` with the generic fix)."""
    return _setting_hint(model, ("layerdrop",), "LayerDrop",
                         "in training each layer draws a random number and Python skips the "
                         "layer on it", "every layer then runs, as in evaluation")


def _config_values(model: torch.nn.Module, suffixes: tuple) -> dict:
    """The settings of every transformers config in ``model`` named with one of ``suffixes``
    and set above 0."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        for key in dir(config) if config is not None else ():
            if key.endswith(suffixes) and not key.startswith("_"):
                value = getattr(config, key, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    found[key] = value
    return found


def specaugment_hint(model: torch.nn.Module) -> str:
    """A hint when a transformers config sets SpecAugment (``mask_time_prob``,
    ``mask_feature_prob`` > 0, Park et al. 2019): in training the audio models draw its
    masks with numpy on the host (``_compute_mask_indices``), values no graph holds
    (HuBERT in a held-out zoo, refused at ``np.put_along_axis``)."""
    return _setting_hint(model, ("mask_time_prob", "mask_feature_prob"), "SpecAugment",
                         "in training its masks are drawn with numpy outside torch",
                         "mask the features in your data pipeline instead, if you need it")


def _setting_hint(model: torch.nn.Module, suffixes: tuple, name: str, why: str,
                  then: str) -> str:
    """The hint for a training-only setting of the model's transformers config that no
    captured graph can hold (:func:`_config_values` of ``suffixes``): names each key, ``why``,
    and the fix, with what follows from it (``then``); "" where none is set or in eval."""
    set_ = _config_values(model, suffixes)
    if not set_ or not model.training:
        return ""
    keys = ", ".join(f"{k}={v}" for k, v in sorted(set_.items()))
    return (f"\nThe model's config sets {name} ({keys}): {why}, which no captured graph can "
            f"hold. Set {' and '.join(f'config.{k} = 0.0' for k in sorted(set_))} in "
            f"build_model() to compile it ({then}).")


def loss_hint(args, kwargs, error: Exception, model_file: Path) -> str:
    """A hint when the capture failed in the model's own loss: the line that failed reads the
    labels (transformers' ``labels.max() >= vocab_size`` check) or the op is a loss whose
    output shape depends on the data (``aten._ctc_loss``). The loss then belongs in
    model.py's ``loss_fn(outputs, batch)``, which runs as it is, outside the graph."""
    labels = [k for k in kwargs if "label" in k.lower()]
    where = user_frame(error, model_file)
    in_loss = "loss" in str(error).splitlines()[0].lower() if str(error).strip() else False
    if not in_loss and not (labels and any(k in where for k in labels)):
        return ""
    drop = (f"leave {', '.join(labels)} out of example_inputs() (the model then returns its "
            f"outputs, not a loss) and " if labels else "")
    return (f"\nThe capture failed in the model's loss: {drop}compute the loss in model.py's "
            f"loss_fn(outputs, batch) (a mean over samples), which runs as written, outside "
            f"the captured graph.")
