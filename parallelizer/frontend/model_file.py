"""The model.py contract: import the user's file, build the model, take its example batch.

One loader serves every entry point that reads a model.py: the compiler, the layout advisor,
``parallelize estimate`` and the emitted ``run.py`` (which loads ``OUT/model.py`` under the same
module name, :data:`parallelizer.plan.parallel_plan.MODEL_MODULE`, so output types model.py
defines get one pytree name at compile time and at run time). Errors name the file and the
line of the user's code that failed.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

import torch

from ..errors import ModelFileError
from ..plan.parallel_plan import MODEL_MODULE

REQUIRED = ("build_model", "example_inputs")


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
    values = batch.values() if isinstance(batch, dict) else batch
    for v in values:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            raise ModelFileError(f"example_inputs() in {module.__file__} must hold tensors with a "
                                 f"batch dim (dim 0); got {type(v).__name__} "
                                 f"{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
    return batch


def user_frame(e: BaseException, model_file: Path) -> str:
    """' at FILE:LINE: source' for the deepest frame in the user's code (model.py first, else
    the deepest frame outside torch and parallelizer), or '' when none is found."""
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(__file__)
    model_file = str(Path(model_file).resolve())
    chosen = [f for f in frames if os.path.abspath(f.filename) == model_file]
    if not chosen:
        chosen = [f for f in frames if not f.filename.startswith((torch_dir, own_dir))
                  and "<" not in f.filename]
    if not chosen:
        return ""
    f = chosen[-1]
    return f"\n  at {f.filename}:{f.lineno}: {(f.line or '').strip()}"
