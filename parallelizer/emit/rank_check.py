"""The emitted program executed on one tp rank's shapes before OUT/ is written.

Each stage's emitted module (``program/stage{i}.py``, the source run.py imports) is built
under torch's ``FakeTensorMode`` (tensors with shapes, dtypes and strides, no storage), its
parameters of the local shapes the plan gives a tp rank, and run forward and backward on
one microbatch of the example batch, with the runtime's own operators (the f/g, vocab and
sequence-parallel autograd Functions) and shape-faithful stand-ins for their collectives
(``runtime.tp.ShapeTransport``, ``runtime.sequence.ShapeComm``: all-reduce keeps the
shape, all-gather multiplies the dim by tp, reduce-scatter divides it). A stage's inputs
are its predecessor's outputs; each stage's outputs get a gradient of ones. Then every
parameter and its gradient must have the plan's local shape.

This catches what a cluster would otherwise meet inside a forward: a shape constant left
global (a head count the planner could not see), an op whose local shapes do not fit, an
autograd error such as an in-place update of a view a custom Function returned. Any such
exception is a PlanError naming the op and the model's source line (the emitted line's
node, ``analysis.graph_facts.source_line``). One tp rank is run per stage: the ranks of a
stage run one program on tensors of one shape (they differ only in which piece they hold),
and the middle instances of a repeated block replay their predecessor's shapes.
"""
from __future__ import annotations

import functools
import re
import sys
import traceback
import warnings

import torch

from ..analysis.gradients import op_name
from ..analysis.graph_facts import module_path, source_line
from ..errors import PlanError
from ..frontend.exporting import FAKE_TENSOR_LOG, quiet_logs
from ..frontend.model_file import headline
from ..frontend.vmap_regions import levels_restored
from ..runtime import expert_parallel, sequence
from ..runtime.batching import flatten
from ..runtime.fake_kernels import fake_forward_kernels
from ..runtime.stage_builder import stage_class_from_source
from ..runtime.tp import ShapeTransport, using_transport
from .numerics_compare import FIX

_BUG = "internal error (a bug in parallelizer, please report it): "


def check_ranks(plan, sources: dict, batch, graphs: list) -> None:
    """Run every stage of the emitted program for one tp rank on FakeTensors.

    Args:
        sources: the emitted sources (``program/stage{i}.py``).
        batch: the example batch (tuple or dict; real or meta tensors).
        graphs: per stage, ``(stage graph, {block fqn: block graph})`` (for messages).

    Raises:
        PlanError: a stage fails forward or backward on a rank's shapes (names the op and the
            model's source line), or a parameter or gradient has another shape than planned.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    tp = plan.mesh["tp"]
    # a shape env: a value read from a tensor (``.item()``, ``.tolist()``: MoE expert sizes)
    # is a data-dependent SymInt there, as in the capture, not an exception; the python
    # dispatcher takes such sizes through the ops' SymInt decompositions, as the capture did
    # (``F.pad(a, (0, n - a.size(2)))`` after ``nonzero``: aten.pad's C++ kernel wants ints)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()), \
            enable_python_dispatcher(), using_transport(ShapeTransport(tp)), \
            sequence.using_comm(sequence.ShapeComm(tp)), expert_parallel.balanced_shapes(plan.ep), \
            fake_forward_kernels(), warnings.catch_warnings(), quiet_logs(FAKE_TENSOR_LOG):
        warnings.simplefilter("ignore")
        inputs = _microbatch(plan, batch)
        for st in plan.stages:
            inputs = _run_stage(plan, st, sources[f"program/{st.module}.py"], inputs,
                                graphs[st.index])


def share_rows(plan, batch) -> tuple[int, int]:
    """(the samples of one microbatch of one dp rank of the example batch: what one stage
    runs at a time, and what the check runs; the example batch's)."""
    m = plan.microbatches if plan.mesh["pp"] > 1 else 1
    size = flatten(plan, batch)[0].shape[0]
    return max(1, size // (plan.mesh["dp"] * m)), size


def _microbatch(plan, batch) -> list:
    """One microbatch of one dp rank, as FakeTensors on the CPU (an input without the batch
    dim whole, as ``batching.dp_slice`` gives it)."""
    rows, size = share_rows(plan, batch)
    return [torch.empty(((rows,) if t.shape[0] == size else t.shape[:1]) + tuple(t.shape[1:]),
                        dtype=t.dtype) for t in flatten(plan, batch)]


def _run_stage(plan, st, source: str, inputs: list, graphs) -> list:
    filename = f"<compile check of program/{st.module}.py>"
    module = stage_class_from_source(source, st.index, filename)("cpu")
    _check_shapes(plan, module, st, "parameter", lambda p: p)
    _replay_repeated_blocks(module)
    try:
        with levels_restored():
            out = module(*inputs)
        flat = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        diff = [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    except Exception as e:  # noqa: BLE001 - any failure here is the compiler's
        raise PlanError(_describe(e, st, source, filename, module, graphs, inputs) + FIX) from e
    finally:
        sys.modules.pop(f"parallelizer_program_stage{st.index}", None)
    _check_shapes(plan, module, st, "gradient", lambda p: p.grad)
    return [o.detach().requires_grad_(o.is_floating_point() or o.is_complex())
            if isinstance(o, torch.Tensor) else o for o in flat]


def _replay_repeated_blocks(module) -> None:
    """Blocks of one emitted class between its second and its last instance replay the
    second's output shapes (when their inputs have the second's shapes, strides and dtypes):
    one class is one program, so the second instance stands for them (its inputs come from
    the first, as theirs do from one another), and a 70B stage costs a few blocks, not all."""
    by_class: dict = {}
    for _fqn, block in module.emitted_blocks():
        by_class.setdefault(type(block), []).append(block)
    for blocks in by_class.values():
        if len(blocks) <= 3:
            continue
        shapes = _Shapes()
        blocks[1].register_forward_hook(shapes.record)
        for b in blocks[2:-1]:
            b.forward = functools.partial(_replayed, shapes, b, b.forward)


def _meta(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    return ("value", x)


class _Shapes:
    """The inputs' and outputs' metadata of one block call (a forward hook)."""

    def __init__(self):
        self.inputs = self.outputs = None
        self.tuple = True

    def record(self, _module, args, out):
        self.tuple = isinstance(out, (tuple, list))
        outs = tuple(out) if self.tuple else (out,)
        if all(isinstance(o, torch.Tensor) for o in outs):
            self.inputs = [_meta(a) for a in args]
            self.outputs = [(tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs]


def _replayed(shapes: _Shapes, block, forward, *args):
    if shapes.outputs is None or [_meta(a) for a in args] != shapes.inputs:
        return forward(*args)
    anchor = next(block.parameters(), None)
    if anchor is None:
        return forward(*args)
    out = _Replay.apply(shapes.outputs, anchor, *args)
    return out if shapes.tuple else out[0]


class _Replay(torch.autograd.Function):
    """Fresh outputs of the recorded shapes; gradients of zeros to the tensor inputs."""

    @staticmethod
    def forward(ctx, outputs, anchor, *args):
        ctx.inputs = [(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args]
        outs = tuple(torch.empty_strided(shape, stride, dtype=dtype)
                     for shape, stride, dtype in outputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *[torch.zeros(m[0], dtype=m[1]) if m is not None and
                              (m[1].is_floating_point or m[1].is_complex) else None
                              for m in ctx.inputs])


def _check_shapes(plan, module, st, what: str, pick) -> None:
    tp = plan.mesh["tp"]
    for name, p in module.named_parameters():
        t = pick(p)
        fqn = plan.aliases.get(name, name)
        if t is None or fqn not in plan.tensors:
            continue
        want = plan.tensors[fqn].rank_shape(tp)
        if tuple(t.shape) != tuple(want):
            raise PlanError(f"{_BUG}on a tp rank of stage {st.index}, the {what} of {fqn} has "
                            f"shape {tuple(t.shape)}, the plan's local shape is {tuple(want)}"
                            f"{FIX}")


def _describe(e: Exception, st, source: str, filename: str, module, graphs, inputs) -> str:
    """The failure as one message: the op and model line of the emitted line that raised
    (found in the traceback, or for a backward failure in the forward's, re-run under
    autograd's anomaly mode), and the exception."""
    lineno = _emitted_line(e.__traceback__, filename)
    if lineno is None:
        lineno = _forward_line_of_backward_failure(module, inputs, filename)
    node = _node_at(source, lineno, module, graphs) if lineno else None
    first = headline(e)
    if node is None:
        where = f"stage {st.index}" + (f" (program/{st.module}.py line {lineno})" if lineno else "")
    else:
        line = source_line(node) or "an unknown line of the model"
        where = (f"{op_name(node.target)} ({node.name}) at {line} in "
                 f"{module_path(node) or 'the root module'}, stage {st.index}")
    return (f"{_BUG}the program fails on a tp rank's shapes at {where}: "
            f"{type(e).__name__}: {first}")


def _emitted_line(tb, filename: str):
    line = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            line = lineno
    return line


def _forward_line_of_backward_failure(module, inputs, filename: str):
    """Re-run forward and backward under anomaly mode: the failing backward node's forward
    traceback names the emitted line that created it."""
    caught: list = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                out = module(*[i.detach().requires_grad_(i.requires_grad)
                               if isinstance(i, torch.Tensor) else i for i in inputs])
                flat = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                diff = [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad]
                torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
        except Exception:  # noqa: BLE001 - the same failure again
            caught = [str(w.message) for w in seen]
    for text in reversed(caught):
        found = re.findall(rf'File "{re.escape(filename)}", line (\d+)', text)
        if found:
            return int(found[-1])
    return None


def _node_at(source: str, lineno: int, module, graphs):
    """The graph node assigned on line ``lineno`` of the emitted ``source``: in the stage's
    own graph, or in the block graph of the class that line belongs to."""
    lines = source.splitlines()
    if not 0 < lineno <= len(lines):
        return None
    m = re.match(r"\s*(\w+)\s*=", lines[lineno - 1])
    cls = next((re.match(r"class (\w+)\(", lines[i]).group(1) for i in range(lineno - 1, -1, -1)
                if lines[i].startswith("class ")), None)
    if m is None or cls is None:
        return None
    stage_graph, blocks = graphs
    graph = stage_graph
    if not cls.startswith("Stage"):
        fqn = next((f for f, _c in module.SUBMODULES
                    if type(module.get_submodule(f)).__name__ == cls), None)
        graph = blocks.get(fqn)
    if graph is None:
        return None
    return next((n for n in graph.nodes if n.name == m.group(1)), None)
