"""Python branches on a tensor's values in forward (ESM-2's ``if not padding_mask.any():
padding_mask = None``), which torch.export cannot trace: with
``capture.data_dependent_branches: as_example`` the capture takes the branch the example batch
takes, by ``torch.export.draft_export`` (it decides each such condition by the example's values
and keeps it in the graph as a runtime assertion), and names each line it decided."""
from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch._logging.structured import INTERN_TABLE
from torch.export._draft_export import FailureType

from ..errors import CaptureError
from ..plan.parallel_plan import DROPOUT_OPS, RANDOM_OPS
from .source_lines import model_line, shown_path

ASSUMED = "assumed_branches"  # gm.meta key: the lines whose branch the example decided
SPEC_KEY = "capture.data_dependent_branches"
_SYMBOL = re.compile(r"\b(?:u|zuf)\d+\b")  # unbacked ints and floats
_LEGEND = "u0, u1, ... (zuf0, ... floats): the values the code reads from tensors"
ANOTHER_BRANCH = "this step takes another branch"  # how the assertions' messages begin


def is_data_dependent(error: BaseException) -> bool:
    """``error`` (or an exception it was raised from) is torch.export's failure to decide a
    condition on a tensor's values (``GuardOnDataDependentSymNode``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ == "GuardOnDataDependentSymNode":
            return True
        error = error.__cause__ or error.__context__
    return False


def decided_lines(ep) -> list[str]:
    """``file.py:line: code (on the example batch <condition> is <value>)`` for each condition
    draft_export decided by the example's values.

    Raises:
        ValueError: the report holds another kind of failure (a missing fake kernel, a guard
            it added), which this route does not make sound; the message names it.
    """
    report = ep._report
    other = [f for f in report.failures if f.failure_type != FailureType.DATA_DEPENDENT_ERROR]
    if other:
        raise ValueError(f"torch.export.draft_export also reported {other[0].failure_type}")
    # the report names only the files first interned by this export; the table has them all
    files = {i: name for name, i in INTERN_TABLE.items()} | dict(report.str_to_filename)
    lines = []
    for failure in report.failures:
        frame = failure.data["user_stack"][-1] if failure.data.get("user_stack") else {}
        path = files.get(frame.get("filename"), "?")
        where = f"{shown_path(path)}:{frame.get('line', '?')}: {frame.get('loc', '').strip()}"
        lines.append(f"{where} (on the example batch {failure.data['expr']} is "
                     f"{failure.data['result']})")
    return lines


def refuse_random_conditions(graph: torch.fx.Graph, model_file) -> None:
    """A condition draft_export decided (the runtime assertion it kept) that reads a random
    draw: LayerDrop's ``if not (self.training and torch.rand(1).item() <= p)`` (torchaudio's
    wav2vec2, zoo 22 F5) takes either branch from step to step, so the branch the example
    took cannot be captured: the self-check's reference drew again and differed (an internal
    error), or a training step stopped with "Runtime assertion failed for expression 0.2 <
    zuf0".

    Raises:
        CaptureError: names the condition's line, the draw and the fix.
    """
    for node in graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default:
            continue
        draw = _random_source(node)
        if draw is None:
            continue
        where, drawn = model_line([node]) or "a line export did not record", model_line([draw])
        raise CaptureError(
            f"{model_file}: the branch at {where} is decided by a random draw ({draw.target}"
            f"{f' at {drawn}' if drawn else ''}), as LayerDrop or "
            f"stochastic depth skip a layer at random: steps take either branch, so the one the "
            f"example took ({SPEC_KEY}: as_example) cannot be captured. Set that probability "
            f"to 0 in the model's config (torchaudio's encoder_layer_drop, Hugging Face's "
            f"layerdrop), or skip by multiplying with a random mask (a drop path), which the "
            f"program draws as it draws dropout")


def _random_source(node: torch.fx.Node):
    """The first random op (dropout's or another draw, plan/parallel_plan.py) ``node``'s value
    is computed from, or None."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if str(n.target) in RANDOM_OPS or str(n.target) in DROPOUT_OPS:
            return n
        todo += n.all_input_nodes
    return None


@contextlib.contextmanager
def quiet_report():
    """draft_export logs its report (tens of lines) as a warning; the compile's own warning
    names the lines instead."""
    log = logging.getLogger("torch.export._draft_export")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def label_assertions(gm: torch.fx.GraphModule, lines: list[str]) -> None:
    """Give the runtime assertions draft_export kept for the decided conditions (on the
    unbacked symbols ``u0``, ``u1``, ... of the values they read) a message naming the lines
    and the fix, in place of "Runtime assertion failed for expression Ne(u0, 1)"."""
    text = (f"{ANOTHER_BRANCH} of the model's code than the example batch took "
            f"at compile ({SPEC_KEY}: as_example): {'; '.join(lines)} ({_LEGEND}). Give "
            f"example_inputs() a batch that takes the branch your data takes, or make the line "
            f"traceable")
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_scalar.default and len(node.args) > 1 \
                and isinstance(node.args[1], str) and _SYMBOL.search(node.args[1]):
            node.args = (node.args[0], f"{text} [{node.args[1]}]")
    gm.recompile()


def decided_warnings(gm: torch.fx.GraphModule) -> list[str]:
    """The compile's warning for each line whose branch the example batch decided."""
    return [f"{SPEC_KEY}: as_example: the capture took the branch the example batch takes at "
            f"{line} ({_LEGEND}); a step whose batch (or the model's own state, a counter it "
            f"keeps) takes the other branch stops with an error naming that line"
            for line in gm.meta.get(ASSUMED, ())]


def check_step_branches(error: BaseException) -> None:
    """Where a check's step of the program (the self-check: the example batch, random ops
    fixed to stand-ins) stopped at a decided branch, the condition depends on more than the
    batch (a random draw, ST-MoE's router noise; the model's state), and the program would
    stop on some training steps too: a user error naming it, not a bug of the compiler.

    Raises:
        CaptureError: ``error`` is such a stop.
    """
    text = str(error)
    if text.startswith(ANOTHER_BRANCH):
        lines = text.split(f"({SPEC_KEY}: as_example): ", 1)[-1].split(". Give ")[0]
        raise CaptureError(
            f"{SPEC_KEY}: as_example: the program's step on the example batch with its random "
            f"ops fixed (the compile's self-check) takes another branch than the capture did "
            f"at {lines}. The condition depends on random draws or on the model's state, not "
            f"on the batch alone, so steps would stop at random; it cannot be captured as the "
            f"example takes it. Make the line traceable, or use a model setting without it"
        ) from error


def check_example_chunks(gm: torch.fx.GraphModule, input_names, batch, chunks: int) -> None:
    """Where the example batch decided a branch (``as_example``) and the layout cuts each
    step's batch into ``chunks`` equal row chunks (mesh.dp x pipeline.microbatches, in
    order), each chunk of the example must take the branch the whole example took: the
    program checks it on every chunk it runs, so one that does not stops ``run.py --verify``
    on the example itself (fair-esm's ESM-2 with padding in one row, at pp2 x 4
    microbatches and at dp2, zoo 21 F2). Runs the captured graph, which holds the check,
    on each chunk (no gradient, torch's generator put back).

    Raises:
        CaptureError: a chunk takes the other branch, naming it, the lines and the fix.
    """
    if chunks <= 1 or not gm.meta.get(ASSUMED):
        return
    flat = [batch[n] for n in input_names] if isinstance(batch, dict) else \
        [batch] if isinstance(batch, torch.Tensor) else list(batch)
    rows = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim()), 0)
    if not rows or rows % chunks:
        return  # the spec check names a batch the layout does not divide
    n = rows // chunks
    for c in range(chunks):
        part = [t[c * n:(c + 1) * n] if isinstance(t, torch.Tensor) and t.dim()
                and t.shape[0] == rows else t for t in flat]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                gm(*part)
        except Exception as e:  # noqa: BLE001  only the decided branch's check is ours here
            if ANOTHER_BRANCH not in str(e):
                return  # the program's own checks meet it, with their own message
            raise CaptureError(
                f"{SPEC_KEY}: as_example: the example batch takes the branch at "
                f"{'; '.join(gm.meta[ASSUMED])}, but its rows {c * n}..{(c + 1) * n - 1}, "
                f"chunk {c + 1} of the {chunks} the layout cuts each step into (mesh.dp x "
                f"pipeline.microbatches), take the other one, so run.py --verify would stop "
                f"there on the example itself, as would every step with such a chunk. Give "
                f"example_inputs() a batch each of whose {chunks} chunks takes the branch "
                f"your data takes (for a padding test: padding in every chunk), or make the "
                f"line traceable") from e
