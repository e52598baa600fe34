"""Parameters the model's forward writes in place: ``nn.Embedding(max_norm=...)``
renormalises the rows it looks up (``aten.embedding_renorm_`` on ``weight.detach()``), a
hand-written weight clamp or EMA of a parameter under ``no_grad``. Under data parallelism
each rank would write only its own copy, from its own samples (DDP), or a gathered copy
FSDP2 then drops: the replicas drift apart from the unmodified model. Reads the captured
graph (ATen schemas' write annotations, followed back through views and ``detach``:
``writes.written_attrs``)."""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.fx as fx

from ..errors import PlanError
from ..frontend.graph_rewrite import returns_view
from .graph_facts import module_path, source_line
from .writes import written_attrs


def parameter_writes(gm: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    """``(parameter fqn, first writing node)`` for each trainable parameter some op writes
    in place (:func:`parallelizer.analysis.writes.written_attrs`)."""
    return [(t, n) for t, n in written_attrs(gm.graph).items() if _is_parameter(gm, t)]


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    """Whether get_attr ``target`` is a trainable tensor (not a buffer)."""
    try:
        t = attrgetter(target)(gm)
    except AttributeError:
        return False
    return isinstance(t, torch.Tensor) and t.requires_grad


def check_parameter_writes(gm: fx.GraphModule, dp: int, pp: int = 1,
                           microbatches: int = 1) -> None:
    """At ``dp`` > 1 or ``pp`` > 1, refuse a forward that writes a parameter in place.

    Raises:
        PlanError: names the parameter, the op, its module and source line, and the fixes.
    """
    if dp <= 1 and pp <= 1:
        return
    found = parameter_writes(gm)
    if dp <= 1:
        found = [(t, n) for t, n in found if _saved_for_backward(gm.graph, t)]
    if not found:
        return
    fqn, node = found[0]
    where = source_line(node)
    key, why, other = (f"mesh.dp={dp}", "each data-parallel rank would write only its own copy, "
                       "from its own samples, and the replicas would drift apart from the "
                       "model", "mesh.dp=1") if dp > 1 else (
        f"mesh.pp={pp}", f"the pipeline runs forward once per microbatch (pipeline.microbatches "
        f"= {microbatches}), several before the first backward: each would write it again "
        f"while an earlier microbatch's backward still needs the value it read (autograd "
        f"refuses that at run time), where the model writes it once per step", "mesh.pp=1")
    raise PlanError(
        f"{key}: the model's forward writes parameter {fqn} in place ({node.target} "
        f"({node.name}) in {module_path(node) or 'the root module'}"
        f"{f' at {where}' if where else ''}; nn.Embedding(max_norm=...) renormalises the rows "
        f"it looks up so, a constraint under no_grad clamps a weight so): {why}. Write it "
        f"outside forward (max_norm=None in build_model, renormalising or clamping after the "
        f"optimizer step), or compile with {other}")


# ops whose backward reads none of the weight's values: a write between a microbatch's
# forward and its backward changes nothing autograd kept (nn.Embedding(max_norm=...)'s renorm,
# idempotent per row, so once per microbatch equals the model's once per step)
_KEEPS_NO_VALUE = {torch.ops.aten.embedding.default}


def _saved_for_backward(graph: fx.Graph, target: str) -> bool:
    """Some op other than a write reads get_attr ``target`` (through views and detach) and
    may keep its value for backward."""
    todo = [n for n in graph.nodes if n.op == "get_attr" and n.target == target]
    while todo:
        node = todo.pop()
        for u in node.users:
            if u.target is torch.ops.aten.detach.default or (returns_view(u) and u.args[0] is node):
                todo.append(u)  # an in-place write returns its input too: followed, not counted
            elif u.target not in _KEEPS_NO_VALUE:
                return True
    return False


def written_buffer_warnings(gm: fx.GraphModule, microbatches: int) -> list[str]:
    """The compile's warning where forward writes buffers in place (running statistics,
    spectral_norm's power-iteration vectors, a step counter) and the step runs it once per
    microbatch: updated ``microbatches`` times per step where the model updates them once."""
    if microbatches <= 1:
        return []
    found = [(t, n) for t, n in written_attrs(gm.graph).items() if not _is_parameter(gm, t)]
    if not found:
        return []
    target, node = found[0]
    where = source_line(node)
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return [f"forward writes buffer {target}{more} in place ({node.target}"
            f"{f' at {where}' if where else ''}: running statistics, spectral_norm's power "
            f"iteration, a counter); the step runs forward once per microbatch "
            f"(pipeline.microbatches = {microbatches}), so they are updated {microbatches} "
            f"times per step where the model's one forward updates them once, and run.py "
            f"--verify may differ by that; pipeline.microbatches=1 updates them as the model "
            f"does"]
