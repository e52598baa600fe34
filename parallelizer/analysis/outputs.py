"""The model's flat outputs under microbatches: which carry the batch dim, which are losses.

torch.distributed.pipelining merges each output of the last stage over microbatches by
``output_merge_spec`` (``microbatch.merge_chunks``): concatenated along dim 0 by default,
or reduced by a ``_CustomReducer``. A 0-dim floating-point output (Hugging Face
``outputs.loss`` when forward gets ``labels=``, an MoE auxiliary loss) is the model's own
mean over the samples it saw, so the program reduces it as the mean over microbatches,
the same mean ``scale_grads=True`` takes of the gradients; any other output must have the
batch dim first.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from ..errors import PlanError
from ..frontend.branches import ASSUMED
from ..frontend.guards import FIXED_BY, batch_breaks, kept, pinned
from ..plan.size_guards import sequence_dims as _sequence_dims
from .graph_facts import input_values, source_line

# ops whose int arguments are sizes: where a batch size fixed by the model's code shows
_SIZED = {"expand", "view", "reshape", "_unsafe_view", "repeat", "new_zeros", "new_ones",
          "new_empty", "new_full", "zeros", "ones", "empty", "full", "arange", "randn", "rand"}


def _flat_outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.output_node()
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in out.args[0]]
    return vals


def _output_name(out_spec, i: int) -> str:
    """Flat output ``i`` by its path in the forward's output (``outputs.router_logits[0]``
    of a ModelOutput), else by its index."""
    if out_spec is None:
        return str(i)
    try:
        paths, _ = tree_flatten_with_path(tree_unflatten(list(range(out_spec.num_leaves)),
                                                         out_spec))
        return f"{i} (outputs{keystr(paths[i][0])})"
    except Exception:  # noqa: BLE001 - a structure pytree cannot walk: the index names it
        return str(i)


def _made_at(gm: fx.GraphModule, i: int) -> str:
    """" (made by OP at FILE:LINE)" for flat output ``i``: the op returning it and the
    model's line, where known."""
    node = gm.graph.output_node().args[0][i]
    while isinstance(node, fx.Node) and node.op == "call_function" and not source_line(node) \
            and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]  # a view export added after the model's own op
    where = source_line(node) if isinstance(node, fx.Node) else None
    return f" (made by {node.target} at {where})" if where else ""


def scalar_outputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Indices of the 0-dim floating-point flat outputs (losses, averaged over microbatches
    and data-parallel ranks)."""
    return tuple(i for i, v in enumerate(_flat_outputs(gm))
                 if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point())


def check_batch_is_dynamic(gm: fx.GraphModule, input_names, chunks: int = 2) -> None:
    """Under pp > 1 (or microbatches > 1 at pp 1) the step runs the graph on microbatches of
    the example batch: the captured
    graph must hold the first input's batch as a symbol. Code that turns it into a Python
    int (``len(x)``: ``__len__`` must return an int, so torch.export specialises the size;
    ``int(x.shape[0])``) fixes it at the example's size, and the stages failed on the
    microbatch's shapes (an internal error at the first op sized by it).

    Raises:
        PlanError: names the input, the fixed size, the first op sized by it (its line) and
            the fix.
    """
    first = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == input_names[0])
    val = first.meta.get("val")
    # a size export specialised is a SymInt whose expression is a number
    if not isinstance(val, torch.Tensor) or not val.dim() or not str(val.shape[0]).isdigit() \
            or int(str(val.shape[0])) <= 1:
        _check_batch_guards(gm, chunks)
        return
    batch = int(str(val.shape[0]))
    where = _sized_by(gm, batch)
    why = gm.meta.get(FIXED_BY)
    if gm.meta.get(ASSUMED):
        raise PlanError(_as_example_fixed("batch size", batch, input_names[0], 0))
    raise PlanError(
        f"the model's code fixes the batch size at the example's {batch} (dim 0 of input "
        f"{input_names[0]!r} is a constant in the captured graph, not a symbol"
        f"{f': captured with it symbolic, it fails ({why})' if why else ''})"
        f"{'; the first op sized by it: ' + where if where else ''}; under mesh.pp > 1, "
        f"pipeline.microbatches > 1 or mesh.dp > 1 the step runs fewer samples at a time. "
        f"Size by the tensor (x.shape[0], x.size(0), x.expand(x.shape[0], ...)) rather than a "
        f"Python int (len(x), int(x.shape[0])), or use mesh.pp=1, mesh.dp=1 and "
        f"pipeline.microbatches=1")


def _check_batch_guards(gm: fx.GraphModule, chunks: int) -> None:
    """Refuse a batch that a guard torch.export recorded holds for the whole example batch
    but not for its share per microbatch and dp rank (``chunks`` of them).

    Raises:
        PlanError: names the input, the guard and the fix: the range of samples it holds
            for where it has a bound above (``ceil(B / 8) == 2``), the fewest samples per
            chunk where fewer than the whole batch hold it (``B != 1``), else that the
            batch is fixed.
    """
    broken = batch_breaks(gm, chunks)
    if broken is None:
        return
    text, name, size, least, fixed, most = broken
    if not fixed and most is not None:
        raise PlanError(
            f"the model's code runs {least} to {most} samples at a time, a range around the "
            f"example's: torch.export guarded `{text}` on dim 0 of "
            f"input {name!r}, which {max(1, size // chunks)} sample(s) break (the example "
            f"batch of {size} cut into {chunks}: mesh.dp x pipeline.microbatches). A larger "
            f"example batch moves the range with it (the guard is captured from it); use "
            f"mesh.pp=1, mesh.dp=1 and pipeline.microbatches=1, or compute the size with "
            f"tensor ops on x.shape[0]")
    if not fixed:
        raise PlanError(
            f"the model's code needs at least {least} samples at a time: torch.export "
            f"guarded `{text}` on dim 0 of input {name!r}, which {max(1, size // chunks)} "
            f"sample(s) break (the example batch of {size} cut into {chunks}: mesh.dp x "
            f"pipeline.microbatches). Use fewer microbatches or dp ranks, or a larger example "
            f"batch in example_inputs(), so that each gets at least {least}")
    if gm.meta.get(ASSUMED):
        raise PlanError(_as_example_fixed("batch size", size, name, 0, text))
    raise PlanError(
        f"the model's code fixes the batch size at the example's {size}: it turns dim 0 of "
        f"input {name!r} into a Python number (int(), math on x.shape), and torch.export "
        f"guarded `{text}`, which fewer samples break; under mesh.pp > 1, "
        f"pipeline.microbatches > 1 or mesh.dp > 1 the step runs fewer samples at a time. "
        f"Compute it with tensor ops on the size, or use mesh.pp=1, mesh.dp=1 and "
        f"pipeline.microbatches=1")


def _as_example_fixed(what: str, size: int, name: str, d: int, guard: str = "") -> str:
    """Why a size is fixed where the capture ran under ``as_example``: torch.export's
    draft_export, deciding branches by the example's values, also turns the size guards of
    the code it runs into the example's sizes, the model's code or not (torch's own
    nn.Transformer's causal-mask test: zoo 18 Z7)."""
    guarded = f" (it guarded `{guard}`)" if guard else ""
    return (f"the capture under capture.data_dependent_branches=as_example fixes the {what} at "
            f"the example's {size}: torch.export.draft_export, which decides the branches by "
            f"the example's values, holds dim {d} of input {name!r} as that number{guarded}, "
            f"whatever code reads it; under mesh.pp > 1, pipeline.microbatches > 1 or mesh.dp "
            f"> 1 the step runs fewer samples at a time. Make the branch it decided traceable "
            f"(the capture hint without as_example names it) and compile without as_example, "
            f"or use mesh.pp=1, mesh.dp=1 and pipeline.microbatches=1")


def _first_op(gm, size: int) -> str:
    where = _sized_by(gm, size) if gm is not None else ""
    return f"; the first op sized by it: {where}" if where else ""


def _sized_by(gm: fx.GraphModule, size: int) -> str:
    """``OP at FILE:LINE`` of the first op of the model's code taking ``size`` as a size
    argument (a view, an expand, an arange) or combining a value with a weight of ``size``
    rows (a learned position table ``x + pos``, pos (1, size, D): broadcasting fixes the
    length there), else ""."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not source_line(n):
            continue
        name = getattr(n.target, "__name__", "").split(".")[0]
        ints = [a for a in n.args[1:] if isinstance(a, int)] + [
            x for a in n.args if isinstance(a, (list, tuple)) for x in a if isinstance(x, int)]
        if name in _SIZED and size in ints or _with_table(n, size):
            return f"{n.target} at {source_line(n)}"
    return ""


def _with_table(n: fx.Node, size: int) -> bool:
    """``n`` is pointwise over a parameter or buffer of 2+ dims whose second-to-last dim is
    ``size`` and another operand computed from the inputs."""
    if torch.Tag.pointwise not in getattr(n.target, "tags", ()):
        return False
    ins = [a for a in n.args if isinstance(a, fx.Node)]
    tables = [a for a in ins if a.op == "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)
              and a.meta["val"].dim() >= 2 and a.meta["val"].shape[-2] == size]
    return bool(tables) and any(a.op != "get_attr" for a in ins)


_DIM_WORDS = {0: ("batch size", "--batch-size", "x.shape[0]"),
              1: ("sequence length", "--seq-len or data.seq_len", "x.shape[1]")}


def fixed_sizes(gm: fx.GraphModule, input_names) -> tuple:
    """``(input name, dim, size, warned)`` for dim 0 (batch) and dim 1 (sequence) of each input
    that the captured graph holds as a constant although capture asked for a symbol
    (``frontend/capture.py`` marks both dynamic): the program then runs only that size, and
    ``run.py`` refuses another ``--batch-size`` / ``--seq-len`` before any forward.
    ``warned``: the compile warns about it: a fixed batch, or a fixed dim 1 of token ids or
    of a 3-dim float input (batch, sequence, features); not an image's channels, which its
    first layer fixes by nature, nor a 2-dim float input's features (an MLP on tabular data). A fixed dim 1 is no sequence where another input's dim 1 is
    a symbol (features beside token ids: the sequence is that input's), and is left out.
    A dim torch.export guarded (``frontend/guards.py``) is fixed too; its ``warned`` is the
    guard's text."""
    out = []
    vals = input_values(gm, input_names)
    sequence = any(v.dim() > 1 and not str(v.shape[1]).isdigit() for _, v in vals)
    for name, val in vals:
        for d in range(min(val.dim(), 2 - sequence)):
            if str(val.shape[d]).isdigit() and int(str(val.shape[d])) > 1:
                warned = d == 0 or not val.is_floating_point() or val.dim() == 3
                out.append((name, d, int(str(val.shape[d])), warned))
    seen = {(name, d) for name, d, _, _ in out}
    symbolic = {(name, d) for name, v in vals for d in range(min(v.dim(), 2))
                if not str(v.shape[d]).isdigit()}
    for text, name, d, size in pinned(gm, symbolic):  # guarded symbols: fixed too, always said
        if (name, d) not in seen and size > 1:
            seen.add((name, d))
            out.append((name, d, size, text))
    return tuple(out)


def size_guards(gm: fx.GraphModule, input_names) -> tuple:
    """The guards on dims 0 and 1 of the inputs that fix no size (:func:`fixed_sizes` has
    those) and that a run's size can break (``frontend/guards.py`` ``kept``: nanoGPT's
    ``T != 64``): ``plan.size_guards``, which run.py evaluates."""
    vals = input_values(gm, input_names)
    symbolic = {(name, d) for name, v in vals for d in range(min(v.dim(), 2))
                if not str(v.shape[d]).isdigit()}
    return tuple(tuple(g) for g in kept(gm, symbolic))


def sequence_dims(gm: fx.GraphModule, input_names) -> tuple:
    """``(input name, dim)`` of each dim past 1 of an input that the captured graph holds as
    an input's sequence length (an explicit (B, S, S) mask's dim 2): run.py resizes it with
    dim 1 (``plan.sequence_dims``)."""
    return _sequence_dims({name: tuple(v.shape) for name, v in input_values(gm, input_names)})


def static_dims(gm: fx.GraphModule, input_names) -> tuple:
    """``(input name, dim)`` of each dim 0 or 1 of an input that the captured graph holds as a
    number (fixed by the model's code, or never a batch or sequence: Whisper's mel bins,
    a conv's channels): ``run.py``'s ``--batch-size`` / ``--seq-len`` resize the others only."""
    return tuple((name, d) for name, val in input_values(gm, input_names)
                 for d in range(min(val.dim(), 2)) if str(val.shape[d]).isdigit())


def fixed_size_warnings(fixed: tuple, gm: fx.GraphModule | None = None) -> list[str]:
    """The compile's warning for each size :func:`fixed_sizes` warns about, naming the first
    op of the model's code sized by it where one is found (``gm``)."""
    out = []
    why = gm.meta.get(FIXED_BY) if gm is not None else None
    for name, d, size, warned in fixed:
        what, flag, fix = _DIM_WORDS[d]
        if warned and gm is not None and gm.meta.get(ASSUMED):
            out.append(f"the capture under capture.data_dependent_branches=as_example fixes the "
                       f"{what} at the example's {size}: torch.export.draft_export holds dim {d} "
                       f"of input {name!r} as that number, whatever code reads it; the program "
                       f"runs only that {what}, and run.py refuses another {flag}. Make the "
                       f"branch it decided traceable and compile without as_example to run any")
        elif why and warned:
            out.append(f"the model's code fixes the {what} at the example's {size}: captured "
                       f"with it symbolic, it fails ({why}), so dim {d} of input {name!r} was "
                       f"captured as that number; the program runs only that {what}, and "
                       f"run.py refuses another {flag}")
        elif isinstance(warned, str):
            out.append(f"the model's code fixes the {what} at the example's {size}: it turns "
                       f"dim {d} of input {name!r} into a Python number (int(), math on "
                       f"x.shape), and torch.export guarded `{warned}`; the program runs only "
                       f"that {what}, and run.py refuses another {flag}. Compute it with "
                       f"tensor ops on the size ({fix}) to run any")
        elif warned:
            out.append(f"the model's code fixes the {what} at the example's {size} (dim {d} of "
                       f"input {name!r} is a constant in the captured graph: a layer over that "
                       f"dim (a Linear mixing the tokens), a Python loop over it, or a size "
                       f"written as a number{_first_op(gm, size)}); the program runs only that {what}, "
                       f"and run.py refuses another {flag}. Size by the tensor ({fix}) to run "
                       f"any")
    return out


def check_outputs_have_batch_dim(gm: fx.GraphModule, input_names, out_spec=None) -> None:
    """Under pp > 1 every output but a 0-dim floating-point one (a loss) is concatenated over
    microbatches along dim 0, which fails on a run for an output without the batch dim.
    ``out_spec``: the forward's output structure, to name an output by its path
    (``outputs.router_logits[0]``).

    Raises:
        PlanError: names the output, its shape and the fix.
    """
    first = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == input_names[0])
    batch = first.meta["val"].shape[0]
    scalars = set(scalar_outputs(gm))
    for i, node in enumerate(gm.graph.output_node().args[0]):
        if node is None:  # torch.distributed.pipelining sends and merges tensors only
            raise PlanError(
                f"output {_output_name(out_spec, i)} of the model is None; under mesh.pp > 1 "
                f"the last stage returns tensors only (torch.distributed.pipelining checks "
                f"each); leave the field out of what forward returns, or use mesh.pp=1")
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if i in scalars or not isinstance(val, torch.Tensor):
            continue
        if val.dim() == 0 or str(val.shape[0]) != str(batch):
            shape = "()" if val.dim() == 0 else str(list(val.shape))
            raise PlanError(
                f"output {_output_name(out_spec, i)} of the model{_made_at(gm, i)} has shape "
                f"{shape} ({val.dtype}), without the batch dim "
                f"of the inputs first; under mesh.pp > 1 each output is concatenated over "
                f"microbatches along dim 0 (a 0-dim floating-point output, a loss, is averaged "
                f"instead), so return per-sample values and reduce them in loss_fn, leave the "
                f"output out (a config flag that adds it: transformers' output_router_logits, "
                f"output_attentions), or use mesh.pp=1")
        pairs = [d for d in range(1, val.dim()) if not str(batch).isdigit()
                 and str(val.shape[d]) == str(batch)]
        if pairs:
            raise PlanError(
                f"output {i} of the model{_made_at(gm, i)} has shape {list(val.shape)} "
                f"({val.dtype}): its dim "
                f"{pairs[0]} is the batch too, a value over pairs of samples (a similarity matrix "
                f"of the batch, CLIP's logits_per_image); under mesh.pp > 1 each microbatch "
                f"pairs only its own samples, so neither this output nor a loss over it is the "
                f"global batch's; use mesh.pp=1")
