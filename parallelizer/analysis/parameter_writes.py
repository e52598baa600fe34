"""Parameters the model's forward writes in place: ``nn.Embedding(max_norm=...)``
renormalises the rows it looks up (``aten.embedding_renorm_`` on ``weight.detach()``), a
hand-written weight clamp or EMA of a parameter under ``no_grad``. Under data parallelism
each rank would write only its own copy, from its own samples (DDP), or a gathered copy
FSDP2 then drops: the replicas drift apart from the unmodified model. Reads the captured
graph (ATen schemas' write annotations, followed back through views and ``detach``)."""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.fx as fx

from ..errors import PlanError
from .graph_facts import module_path, source_line


def parameter_writes(gm: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    """``(parameter fqn, writing node)`` for each in-place write of a trainable parameter
    (an ATen argument marked ``Tensor(a!)`` that is the parameter or a view of it)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            fqn = _parameter_behind(gm, value)
            if fqn is not None:
                out.append((fqn, node))
    return out


def _parameter_behind(gm: fx.GraphModule, value):
    """The fqn of the trainable parameter ``value`` is, or is a view of; else None."""
    while isinstance(value, fx.Node) and value.op == "call_function" and isinstance(
            value.target, torch._ops.OpOverload) and _is_view(value.target) and value.args:
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    try:
        t = attrgetter(value.target)(gm)
    except AttributeError:
        return None
    return value.target if isinstance(t, torch.Tensor) and t.requires_grad else None


def _is_view(op) -> bool:
    """Whether ``op`` returns an alias of its first argument (a view, ``detach``, ``alias``)."""
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def check_parameter_writes(gm: fx.GraphModule, dp: int) -> None:
    """At ``dp`` > 1, refuse a forward that writes a parameter in place.

    Raises:
        PlanError: names the parameter, the op, its module and source line, and the fixes.
    """
    if dp <= 1:
        return
    found = parameter_writes(gm)
    if not found:
        return
    fqn, node = found[0]
    where = source_line(node)
    raise PlanError(
        f"mesh.dp={dp}: the model's forward writes parameter {fqn} in place ({node.target} "
        f"({node.name}) in {module_path(node) or 'the root module'}"
        f"{f' at {where}' if where else ''}; nn.Embedding(max_norm=...) renormalises the rows "
        f"it looks up so): each data-parallel rank would write only its own copy, from its own "
        f"samples, and the replicas would drift apart from the model. Write it outside forward "
        f"(max_norm=None in build_model, renormalising after the optimizer step), or compile "
        f"with mesh.dp=1")
