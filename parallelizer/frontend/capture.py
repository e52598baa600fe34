"""Capture a model as a torch.fx GraphModule.

Capture uses ``torch.export.export(strict=False)`` (ATen training IR with ``nn_module_stack``
metadata and FakeTensor values on every node) with dim 0 (batch) and dim 1 (sequence) of
every input dynamic, so the emitted program runs any batch size and sequence length.
``torch.fx.symbolic_trace`` followed by export of the traced module is the fallback route;
both routes end in the same IR.
"""
from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map

from ..errors import CaptureError
from ..plan.out_spec import dumps as out_spec_dumps, register_dataclasses
from . import capture_hints, custom_functions, python_rng, python_state
from .branches import (ASSUMED, SPEC_KEY, decided_lines, is_data_dependent, label_assertions,
                       quiet_report, refuse_random_conditions)
from .buffer_reads import forward_buffer_reads
from .constant_scalars import fold_constant_scalars
from .conv import channel_maps_as_linears
from .einsum import einsums_as_linears, matmuls_as_linears, zero_baddbmm_as_bmm
from .exporting import captures, export_kept, export_program
from .factories import factories_of_constants
from .fx_trace import symbolic_trace
from .graph_rewrite import returns_view
from .grad_hooks import check_module_hooks, tensor_hooks_refused
from .guards import FIXED_BY, record_shape_guards
from .held_params import held_parameters, read_as_parameters
from .model_file import headline, user_frame
from .module_state import buffer_values_kept, state_kept
from .module_paths import one_name_per_module
from .regions import autocast_off_elided, inline_regions, record_autocast_off
from .saved_reads import copy_reads_before_writes
from .source_lines import model_line, shown_path
from .tiles import tiles_as_repeat
from .vmap_regions import VMAP_LEVELS


def split_args(batch: tuple | dict) -> tuple[tuple, dict]:
    """A batch as the (args, kwargs) it is called with, each tensor a copy: a model that
    writes its input in place (``x.mul_(2)``) leaves the batch as it was, so every run of it
    (export, the reference, the self-check's repeat) reads the same values (zoo 21 F3:
    the second run read the doubled input and the model was taken for one drawing random
    numbers)."""
    batch = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
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


def capture(model: torch.nn.Module, batch: tuple | dict, model_file: Path,
            branches: str = "refuse") -> Captured:
    """Capture ``model`` on ``batch`` as a flat-calling GraphModule. ``branches``:
    ``capture.data_dependent_branches`` (:mod:`.branches`).

    Raises:
        CaptureError: both torch.export and the symbolic_trace route failed; the message
            gives export's reason and the model source line it failed at, when known. Or the
            model applies a torch.autograd.Function whose backward export drops and the
            graph's own gradient differs from (:mod:`.custom_functions`).
    """
    args, kwargs = split_args(batch)
    held = held_parameters(model)
    check_module_hooks(model, model_file)
    with python_rng.no_draws(model, args, kwargs, model_file,
                             lambda: capture_hints.setting_hints(model)), \
            tensor_hooks_refused(model_file), autocast_off_elided() as autocast_off:
        ep, route, applied, fixed, decided = _exported(model, args, kwargs, model_file, branches)
    python_state.refuse_per_call_numbers(model, args, kwargs, model_file)
    gm = ep.module()
    record_autocast_off(gm, autocast_off)
    if fixed:  # for the compile's warning of the fixed size (analysis/outputs.py)
        gm.meta[FIXED_BY] = fixed
    if decided:  # for the compile's warning (compiler.py) and the run's error
        gm.meta[ASSUMED] = decided
        label_assertions(gm, decided)
    read_as_parameters(gm, held)
    out_spec = gm._out_spec
    try:
        out_spec_dumps(out_spec)
    except Exception as e:
        raise CaptureError(f"the output of {model_file}'s forward ({out_spec}) cannot be sent "
                           f"between processes ({type(e).__name__}: {e}); return a tensor, a "
                           f"tuple or dict of tensors, or a Hugging Face ModelOutput") from e
    names = tuple(kwargs) if kwargs else tuple(
        n.name for n in gm.graph.nodes if n.op == "placeholder")
    record_shape_guards(gm, ep, names, tree_flatten((args, kwargs))[0])
    _to_flat_calling(gm)
    one_name_per_module(gm, model)
    inline_regions(gm)
    _refuse_subgraphs(gm, model_file)
    _one_op_per_meaning(gm)
    tiles_as_repeat(gm)
    einsums_as_linears(gm)
    matmuls_as_linears(gm)
    zero_baddbmm_as_bmm(gm)
    factories_of_constants(gm)
    channel_maps_as_linears(gm)
    fold_constant_scalars(gm)
    _drop_dead_code(gm)
    forward_buffer_reads(gm)
    copy_reads_before_writes(gm)
    custom_functions.check_backward(model, gm, args, kwargs, applied, model_file)
    return Captured(gm, names, bool(kwargs), out_spec, route)


def _exported(model, args, kwargs, model_file: Path, branches: str = "refuse"):
    """(ExportedProgram, route, the custom Functions applied, why the sequence or batch had
    to be static or "", the lines whose branch the example decided) of ``model`` on the
    batch: torch.export, else symbolic_trace then export; where both fail with the sizes
    symbolic, torch.export with them static (the compile warns of the fixed sizes, quoting
    the symbolic capture's error); where a branch on a tensor's values stopped them all and
    ``branches`` is "as_example", draft_export (:mod:`.branches`).

    Raises:
        CaptureError: every route failed (the model failing eagerly named as such).
    """
    routes = (("torch.export", lambda: model, False),
              ("symbolic_trace+torch.export", lambda: symbolic_trace(model), False),
              ("torch.export", lambda: model, True))
    first_error = None
    for route, traced, static in routes:
        try:
            with export_kept(model) as applied:
                ep = export_program(traced(), args, kwargs, static)
            break
        except Exception as e:
            first_error = first_error or e
    else:
        eager, opaque = _eager_run(model, args, kwargs)
        # on the meta device (a compile without weights) no value can be read: a model
        # branching on one fails eagerly too, and that says nothing of the model
        on_meta = any(t.is_meta for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor))
        if eager is not None and not (on_meta and is_data_dependent(first_error)):
            raise CaptureError(eager_message(eager, model_file)) from eager
        if register_dataclasses(opaque.values()):  # nodes now: export returns them
            return _exported(model, args, kwargs, model_file, branches)
        if opaque:  # export cannot return it (a transformers Cache: use_cache on)
            raise CaptureError(_opaque_message(list(opaque), model_file)) from first_error
        if branches == "as_example" and is_data_dependent(first_error):
            if on_meta:
                raise CaptureError(_capture_message(first_error, model_file) + f"\n{SPEC_KEY}: "
                                   f"as_example decides the branch by the example's values, "
                                   f"which a compile without the weights (--no-weights, on the "
                                   f"meta device) does not have; compile with the weights")
            ep, applied, decided = _as_example(model, args, kwargs, first_error, model_file)
            return ep, "torch.export.draft_export", applied, "", decided
        raise CaptureError(_capture_message(first_error, model_file)
                           + capture_hints.hints(model, args, kwargs, first_error, model_file,
                                                 functools.partial(captures, model))
                           ) from first_error
    fixed = ""
    if static:
        fixed = (f"{type(first_error).__name__}: {headline(first_error, '')}"
                 f"{user_frame(first_error, model_file)}")
    return ep, route, applied, fixed, []


def _as_example(model, args, kwargs, first_error, model_file: Path):
    """(ExportedProgram, custom Functions applied, decided lines) by draft_export.

    Raises:
        CaptureError: draft_export fails too, or reports what it did not make sound, or a
            decided condition reads a random draw (:func:`.branches.refuse_random_conditions`).
    """
    try:
        with export_kept(model) as applied, quiet_report():
            ep = export_program(model, args, kwargs, exporter=torch.export.draft_export)
        lines = decided_lines(ep)
    except Exception as e:  # noqa: BLE001  the refusal is the first route's error
        raise CaptureError(_capture_message(first_error, model_file) + f"\nWith {SPEC_KEY}: "
                           f"as_example the capture fails as well ({type(e).__name__}: "
                           f"{headline(e, '') or _raised_in(e)}){user_frame(e, model_file)}"
                           f"\nWhere the branch reads the "
                           f"model's own state (a flag a layer sets on its first batch: a "
                           f"codebook or k-means centroids initialised from the data), "
                           f"initialise it in build_model() (one forward on a batch): the "
                           f"example then takes the branch every later step takes.") \
            from first_error
    refuse_random_conditions(ep.graph, model_file)
    return ep, applied, lines


def _raised_in(e: BaseException) -> str:
    """Where an exception with no message was raised: ``raised in FILE:LINE`` (draft_export's
    own StopIteration in torch's lift_constants_pass, on routing-transformer, said nothing)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"raised in {shown_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _drop_dead_code(gm: torch.fx.GraphModule) -> None:
    """Remove the values nothing reads (a stream the last block updates but the model does
    not return, LiLT's layout stream): eager computes them, but their parameters get no
    gradient (None). Kept, the passes fuse them with live ops (the linears sharing one
    sequence-parallel all-gather, one autograd Function) whose backward gives them a zero
    gradient, which weight decay and momentum then apply where the model's optimizer does
    nothing; and they cost compute and collectives. Random draws and writes in place stay
    (``Node.is_impure``): the random streams are the model's. So do the parameter reads
    (``get_attr``), as export made them (a tied weight's unused alias among them). A
    parameter only dead code read is then one the forward never reads (a pooler whose
    output is not returned): in no stage, and export names it (docs/checkpoints.md)."""
    # a torch.vmap level entered and left reads nothing back: dropped, every batch dim
    # added at it met a level never entered, s5-pytorch's S5Block failed at any tp (zoo 25 F3)
    if gm.graph.eliminate_dead_code(lambda n: n.op == "get_attr" or n.is_impure()
                                    or n.target in VMAP_LEVELS):
        gm.recompile()



# ops torch defines as another op with the same arguments (ATen's broadcast_to is
# ``self.expand(size)``), kept apart by torch.export's pre-dispatch graph: one spelling, so
# every rule that reads expand's sizes (the local sizes under tp, repeat_kv) reads both
_SAME_OP = {torch.ops.aten.broadcast_to.default: torch.ops.aten.expand.default}
# a draw given ``generator=None`` (diffusers' ``randn_tensor``) is the draw from the default
# generator, which the program's random streams replace (planning/dropout.py); kept apart,
# the overload had no stream and the model was refused
_DEFAULT_GENERATOR = {
    torch.ops.aten.randn.generator: torch.ops.aten.randn.default,
    torch.ops.aten.rand.generator: torch.ops.aten.rand.default,
    torch.ops.aten.randint.generator: torch.ops.aten.randint.default,
    torch.ops.aten.randint.low_generator: torch.ops.aten.randint.low,
    torch.ops.aten.randperm.generator: torch.ops.aten.randperm.default,
}

_aten = torch.ops.aten
# in-place views: they change their input's shape, not its values (BigBird's
# ``context.unsqueeze_(2)``); as the out-of-place view, read by every later reader of the
# input, the planners see one value per shape and no write
_VIEW_IN_PLACE = {
    _aten.unsqueeze_.default: _aten.unsqueeze.default, _aten.squeeze_.default: _aten.squeeze.default,
    _aten.squeeze_.dim: _aten.squeeze.dim, _aten.squeeze_.dims: _aten.squeeze.dims,
    _aten.transpose_.default: _aten.transpose.int, _aten.t_.default: _aten.t.default,
    _aten.swapdims_.default: _aten.swapdims.default, _aten.swapaxes_.default: _aten.swapaxes.default,
}


def _functional(op):
    """The out-of-place overload of in-place ATen ``op`` (``masked_fill_.Scalar`` ->
    ``masked_fill.Scalar``) returning a new tensor, or None."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    packet, overload = op._schema.name.split("::")[-1], op._overloadname
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    functional = getattr(getattr(torch.ops.aten, packet[:-1], None), overload, None)
    if not isinstance(functional, torch._ops.OpOverload):
        return None
    schema = functional._schema  # a new tensor (detach_ -> detach is a view: left alone)
    return None if schema.is_mutable or any(r.alias_info for r in schema.returns) else functional


def _out_of_place(node: torch.fx.Node, order: dict) -> bool:
    """``node`` writes in place into a tensor the forward made (``softmax(x).masked_fill_(m,
    0)``, ``nn.ReLU(inplace=True)``, ``nn.Dropout(inplace=True)``) or into a model input
    (``x.mul_(2)``), that nothing else aliases: not a parameter or buffer, with no other view
    of it taken; a view of such a tensor counts when the chain of views is the only alias
    and nothing reads the tensors it views after the write. Its out-of-place form, read by
    every later reader of the tensor, computes the same values, and the graph stays
    differentiable where the in-place write had modified a value autograd saved (SEW-D's
    ``XSoftmax``: its own backward allowed the write, the captured forward's softmax
    backward did not). The program then never writes the batch it is given: the pipeline's
    microbatches are views of one batch, sharing its version counter, and a write into one
    failed the backward of another (zoo 21 F3)."""
    if _functional(node.target) is None or not node.args:
        return False
    x = node.args[0]
    if not isinstance(x, torch.fx.Node) or _views_of(x, node):
        return False
    while returns_view(x):  # torchvision's ``Dropout(inplace=True)`` after ``flatten``
        x, view = x.args[0], x
        if _views_of(x, view) or any(order[u] > order[node] for u in x.users if u is not view):
            return False  # another alias of the written memory, or a read after the write
    return x.op in ("call_function", "placeholder")


def _views_of(x: torch.fx.Node, but: torch.fx.Node) -> list:
    return [u for u in x.users if returns_view(u) and u.args[0] is x and u is not but]


def _one_op_per_meaning(gm: torch.fx.GraphModule) -> None:
    """Replace each op of :data:`_SAME_OP` by the op it is defined as, each in-place write
    into a tensor nothing else aliases (:func:`_out_of_place`) by its out-of-place form, and
    each of :data:`_VIEW_IN_PLACE` by its out-of-place view; both are read instead of their
    input after them."""
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _VIEW_IN_PLACE and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].op == "call_function":
            x = node.args[0]
            node.target = _VIEW_IN_PLACE[node.target]
            for u in [u for u in x.users if order[u] > order[node]]:
                u.replace_input_with(x, node)
            changed = True
        elif node.target in _SAME_OP:
            node.target = _SAME_OP[node.target]
            changed = True
        elif node.target in _DEFAULT_GENERATOR and node.kwargs.get("generator") is None:
            node.target = _DEFAULT_GENERATOR[node.target]
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "generator"}
            changed = True
        elif _one_tensor_cat(node):
            # a copy (einops' ``pack([t], '* n d')``): one rule for every placement of t, where
            # cat's keeps its dim whole (a merged (batch, heads) dim kept attention replicated)
            node.target, node.args, node.kwargs = _aten.clone.default, (node.args[0][0],), {}
            changed = True
        elif _out_of_place(node, order):
            x, node.target = node.args[0], _functional(node.target)
            for u in [u for u in x.users if order[u] > order[node]]:
                u.replace_input_with(x, node)
            changed = True
        elif node.target is torch.ops.aten.expand_as.default:
            for size in _expand_to_sizes(gm.graph, node):  # read before node: ordered so
                order[size] = order[node] - 0.5  # (a later in-place write meets them)
            changed = True
    if changed:
        gm.recompile()


def _one_tensor_cat(node: torch.fx.Node) -> bool:
    tensors = node.args[0] if node.target is _aten.cat.default and node.args else None
    return isinstance(tensors, (list, tuple)) and len(tensors) == 1 \
        and isinstance(tensors[0], torch.fx.Node)


def _expand_to_sizes(graph: torch.fx.Graph, node: torch.fx.Node) -> list:
    """``expand_as(x, other)`` as ``expand(x, sizes)``, which ATen defines it as, with
    ``other``'s sizes spelled out (a number, or a ``sym_size`` of ``other`` for a dynamic dim):
    the planner reads expand's sizes (global, made local where the value is sharded), where
    expand_as took a rank's local sizes from ``other`` at run time (F.normalize's norm expanded
    as a column output: cut twice). Returns the ``sym_size`` nodes it inserted."""
    x, other = node.args[0], node.args[1]
    sizes, inserted = [], []
    with graph.inserting_before(node):
        for i, size in enumerate(other.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                dim = graph.call_function(torch.ops.aten.sym_size.int, (other, i))
                dim.meta = {**node.meta, "val": size}
                sizes.append(dim)
                inserted.append(dim)
            else:
                sizes.append(int(size))
    node.target, node.args = torch.ops.aten.expand.default, (x, sizes)
    return inserted


def _refuse_subgraphs(gm: torch.fx.GraphModule, model_file: Path) -> None:
    """Refuse a higher-order op that calls a subgraph (a ``torch.autograd.Function``,
    ``torch.cond``, an autocast region, as torch.export keeps them): the planners read one
    flat graph of ATen ops, and no sharding rule covers a subgraph.

    Raises:
        CaptureError: names the op, the model line and the fix.
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.nn.Module):
            user = next(iter(node.users), node)
            # the op's own trace, else its subgraph's first op's (export records none for
            # an autocast region)
            line = model_line([user]) or model_line(getattr(gm, node.target).graph.nodes)
            if getattr(user.target, "__name__", "") == "wrap_with_autocast":
                raise CaptureError(_autocast_message(user, line, model_file))
            raise CaptureError(
                f"{model_file}: the model calls {getattr(user.target, '__name__', user.target)} on "
                f"a subgraph{f' at {line}' if line else ''} (a torch.autograd.Function, torch.cond "
                f"or an autocast region, as torch.export keeps it); parallelizer rewrites one flat "
                f"graph of ATen ops: write that code as plain tensor operations, or leave it to "
                f"eager mode outside the model's forward")


def _autocast_message(node, line: str, model_file: Path) -> str:
    """The refusal of an autocast region that turns autocast on (regions turning it off are
    no-ops in the capture, frontend/regions.py): the spec's mixed precision is what does it."""
    device, dtype = node.args[0], node.args[1]
    dtype = str(dtype).replace("torch.", "") if dtype is not None else "its default dtype"
    where = line or "a line export did not record"
    return (f"{model_file}: the model turns autocast on ({device}, {dtype}) at {where}; "
            f"the program runs each op in the precision the spec "
            f"sets and cannot keep a region of its own: remove the torch.autocast region and "
            f"set mixed_precision.param_dtype=bf16 (or fp16: every layout runs the stages "
            f"under torch.autocast then, docs/spec.md), or keep that code outside the model's "
            f"forward")


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


def _eager_run(model: torch.nn.Module, args, kwargs) -> tuple[Exception | None, dict]:
    """A plain forward of ``model`` on the example batch: its exception (or None), and each
    output that is neither a tensor nor a plain Python value, ``path (type)`` -> type. The model
    and the random state are left as they were: a lazily initialised buffer written here
    picked the initialised branch for the capture that follows (routing-transformer's
    k-means under as_example, zoo 16 Z9)."""
    try:
        with torch.no_grad(), state_kept(model), buffer_values_kept(model), \
                torch.random.fork_rng(devices=[]):
            out = model(*args, **kwargs)
    except Exception as e:
        return e, {}
    from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path
    plain = (torch.Tensor, int, float, bool, str, type(None))
    try:
        leaves = [(keystr(k), v) for k, v in tree_flatten_with_path(out)[0]]
    except ValueError:  # a pytree node registered without key paths (diffusers' BaseOutput)
        leaves = [(f"[{i}]", v) for i, v in enumerate(tree_flatten(out)[0])]
    return None, {f"outputs{k} ({type(v).__module__}.{type(v).__qualname__})": type(v)
                  for k, v in leaves if not isinstance(v, plain)}


def _opaque_message(opaque: list[str], model_file: Path) -> str:
    return (f"the model from {model_file} returns {', '.join(opaque)}: not a tensor, so "
            f"torch.export cannot capture it.\nFix: return only tensors (in tuples, dicts, "
            f"dataclasses or ModelOutputs); a Hugging Face model returns its key/value cache "
            f"(past_key_values) while use_cache is on: set use_cache=False in its config (and in "
            f"its text_config, for a config that holds one).")


def eager_message(e: Exception, model_file: Path) -> str:
    """The refusal of a model that fails on its example batch as it is (an op the eager
    kernel refuses though export traced it: transformers' grouped_mm on an expert width whose
    rows are not 16-byte aligned), naming the model's line."""
    return (f"the model from {model_file} fails on example_inputs() when it runs as it is, "
            f"without parallelizer: {type(e).__name__}: {headline(e)}{user_frame(e, model_file)}\n"
            f"Fix: the model or example_inputs() (parallelizer compiles what the model computes).")


def _capture_message(e: Exception, model_file: Path) -> str:
    return (f"torch.export could not capture the model from {model_file} "
            f"(the symbolic_trace route failed too): {type(e).__name__}: {headline(e)}"
            f"{user_frame(e, model_file)}\nFix: make the failing line traceable (no data-dependent "
            f"Python control flow on tensor values, no .item()/.tolist() in forward), or return "
            f"only tensors / ModelOutputs from forward; where it fails inside a layer, that "
            f"layer's setting may be the cause (BatchNorm with momentum=None reads its batch "
            f"count as a Python float: give it a momentum).")
