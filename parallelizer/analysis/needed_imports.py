"""Modules the emitted program must import before it builds its stages.

A captured graph can call operators that exist only once some module has run: custom ops
registered with ``torch.library`` (Mixtral's experts call
``torch.ops.transformers.grouped_mm_fallback``, defined when
``transformers.integrations.moe`` is imported), and its output pytree names types that
``treespec_loads`` can rebuild only when their module registered them
(``transformers.modeling_outputs.CausalLMOutputWithPast``). Hugging Face imports both
lazily: a model.py that goes through ``AutoModelForCausalLM.from_config`` never imports
them itself, so ``run.py`` loading model.py is not enough. The compiler records the
modules here (``ParallelPlan.imports``) and ``run.py`` imports them before anything else
(:func:`parallelizer.runtime.imports.import_modules`).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec

# modules that need no import by the program: torch registers its own ops and containers,
# run.py loads model.py under MODEL_MODULE itself (frontend/model_file.py), and a type defined in the
# script that called the Python API (__main__) cannot be imported by name
_PROVIDED = ("builtins", "collections", "torch", "parallelizer", "__main__")


def _provided(module: str, model_module: str) -> bool:
    return module == model_module or module.split(".")[0] in _PROVIDED


@functools.lru_cache(maxsize=None)  # the scan of sys.modules runs once per operator
def op_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers ``op``: the module of a ``torch.library.custom_op``'s
    function, else a loaded module holding a ``torch.library.Library`` of the op's namespace;
    None when none is found (a C++ or torch-internal operator)."""
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS.get(op._schema.name)
    fn = getattr(opdef, "_init_fn", None)
    if fn is not None and getattr(fn, "__module__", None):
        return fn.__module__
    for name, module in list(sys.modules.items()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, torch.library.Library) and value.ns == op.namespace:
                return name
    return None


def _type_modules(spec: TreeSpec) -> list[str]:
    out = [] if spec.type is None else [spec.type.__module__]
    for child in spec.children():
        out += _type_modules(child)
    return out


def modules_needed(graph: fx.Graph, out_spec: TreeSpec, model_module: str) -> tuple[str, ...]:
    """Modules to import before running ``graph`` and rebuilding its outputs with
    ``out_spec``, sorted; model.py itself (``model_module``), torch and the standard
    containers are left out."""
    found = set()
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target.namespace not in ("aten", "prims"):
                found.add(op_module(node.target))
    found.update(_type_modules(out_spec))
    return tuple(sorted(m for m in found if m and not _provided(m, model_module)))
