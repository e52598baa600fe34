"""Capture a model as a torch.fx GraphModule.

Capture uses ``torch.export.export(strict=False)`` (ATen training IR with ``nn_module_stack``
metadata and FakeTensor values on every node) with dim 0 (batch) and dim 1 (sequence) of
every input dynamic, so the emitted program runs any batch size and sequence length.
``torch.fx.symbolic_trace`` followed by export of the traced module is the fallback route;
both routes end in the same IR.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim
from torch.utils._pytree import TreeSpec, tree_flatten, treespec_dumps

from ..errors import CaptureError
from .model_file import user_frame

def split_args(batch: tuple | dict) -> tuple[tuple, dict]:
    """A batch as the (args, kwargs) it is called with."""
    return ((), dict(batch)) if isinstance(batch, dict) else (tuple(batch), {})


@dataclass
class Captured:
    """A captured model. ``gm`` takes the flat inputs positionally (``input_names`` order)
    and returns the flat outputs as a tuple; ``out_spec`` rebuilds the model's own output
    structure (e.g. a Hugging Face ModelOutput) from them."""

    gm: torch.fx.GraphModule
    input_names: tuple[str, ...]
    inputs_are_kwargs: bool
    out_spec: TreeSpec
    route: str


def _dynamic_shapes(args: tuple, kwargs: dict) -> Any:
    def dims(t: torch.Tensor) -> dict:
        return {i: Dim.AUTO for i in range(min(t.dim(), 2))}
    if kwargs:
        return {k: dims(v) for k, v in kwargs.items()}
    return tuple(dims(a) for a in args)


def capture(model: torch.nn.Module, batch: tuple | dict, model_file: Path) -> Captured:
    """Capture ``model`` on ``batch`` as a flat-calling GraphModule.

    Raises:
        CaptureError: both torch.export and the symbolic_trace route failed; the message
            gives export's reason and the model source line it failed at, when known.
    """
    args, kwargs = split_args(batch)
    dyn = _dynamic_shapes(args, kwargs)
    try:
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dyn, strict=False)
        route = "torch.export"
    except Exception as export_error:
        try:
            traced = torch.fx.symbolic_trace(model)
            ep = torch.export.export(traced, args, kwargs, dynamic_shapes=dyn, strict=False)
            route = "symbolic_trace+torch.export"
        except Exception:
            eager = _eager_failure(model, args, kwargs)
            if eager is not None:  # not a tracing problem: the model fails as it is
                raise CaptureError(_eager_message(eager, model_file)) from eager
            raise CaptureError(_capture_message(export_error, model_file)) from export_error
    gm = ep.module()
    out_spec = gm._out_spec
    try:
        treespec_dumps(out_spec)
    except Exception as e:
        raise CaptureError(f"the output of {model_file}'s forward ({out_spec}) cannot be sent "
                           f"between processes ({type(e).__name__}: {e}); return a tensor, a "
                           f"tuple or dict of tensors, or a Hugging Face ModelOutput") from e
    names = tuple(kwargs) if kwargs else tuple(
        n.name for n in gm.graph.nodes if n.op == "placeholder")
    _to_flat_calling(gm)
    return Captured(gm, names, bool(kwargs), out_spec, route)


def _to_flat_calling(gm: torch.fx.GraphModule) -> None:
    """Drop export's pytree in/out conversion and runtime guard call so the graph takes flat
    tensors and returns a flat tuple, which is what pipeline stages send and receive."""
    graph = gm.graph
    gm._forward_pre_hooks.clear()  # export's input-structure check expects the pytree call
    graph._codegen = torch.fx.graph.CodeGen()
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    output = graph.output_node()
    flat, _ = tree_flatten(output.args[0])
    output.args = (tuple(flat),)
    graph.lint()
    gm.recompile()


def _eager_failure(model: torch.nn.Module, args, kwargs) -> Exception | None:
    """The exception of a plain forward of ``model`` on the example batch, or None."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        return e
    return None


def _eager_message(e: Exception, model_file: Path) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"the model from {model_file} fails on example_inputs() when it runs as it is, "
            f"without parallelizer: {type(e).__name__}: {first}{user_frame(e, model_file)}\n"
            f"Fix: the model or example_inputs() (parallelizer compiles what the model computes).")


def _capture_message(e: Exception, model_file: Path) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"torch.export could not capture the model from {model_file} "
            f"(the symbolic_trace route failed too): {type(e).__name__}: {first}"
            f"{user_frame(e, model_file)}\nFix: make the failing line traceable (no data-dependent "
            f"Python control flow on tensor values, no .item()/.tolist() in forward), or return "
            f"only tensors / ModelOutputs from forward.")
