"""Where ``run.py --train`` takes its batches from, in this order: ``batches()`` of model.py,
the spec's ``data:`` token files (runtime/token_data.py), seeded synthetic batches shaped
like ``example_inputs()``. Each source yields this data-parallel rank's rows of the global
batches, on its device; one optimizer step takes ``train.grad_accum`` of them, concatenated
(this rank's rows of each batch, in order). The position (batches consumed) is what a
checkpoint saves: :meth:`seek` goes back to it.
"""
from __future__ import annotations

import itertools

import torch

from ..errors import UserError
from ..plan.parallel_plan import ParallelPlan
from ..plan.size_guards import first_broken, spans_text
from .batching import dp_slice, flatten, synthetic_batches, to_batch
from .token_data import DataError, TokenData


def make_source(plan: ParallelPlan, model_module, spec: dict, ctx, options, split: str = "train"):
    """The batch source of this run (module docstring); ``split`` "eval": ``data.eval``.

    Raises:
        UserError: --batch-size / --seq-len with model.py's batches(), no model.py.
        DataError: the token files (runtime/token_data.py).
    """
    data = spec.get("data") or {}
    has_batches = model_module is not None and hasattr(model_module, "batches")
    if split == "eval":
        return TokenSource(plan, data, ctx, options, data["eval"], "data.eval", False, model_module)
    if has_batches:
        if options.batch_size or options.seq_len:
            raise UserError("--batch-size / --seq-len: model.py defines batches(), which decides "
                            "its own batch shape (and takes precedence over data: and synthetic "
                            "batches); drop the flags or remove batches() from model.py")
        if data.get("path") and ctx.rank == 0:
            print(f"note: model.py's batches() takes precedence over data.path ({data['path']})", flush=True)
        return GlobalSource(plan, model_module.batches(), ctx)
    if data.get("path"):
        return TokenSource(plan, data, ctx, options, data["path"], "data.path",
                           data.get("shuffle", True), model_module)
    if model_module is None:
        raise UserError("--train needs batches: this program has no model.py (compiled from an "
                        "in-memory model); train it through the Python API instead")
    check_fixed_sizes(plan, options.batch_size, options.seq_len, "--batch-size", "--seq-len")
    example = _resized(plan, model_module.example_inputs(), options.batch_size, options.seq_len)
    return GlobalSource(plan, synthetic_batches(plan, example, plan.seed), ctx)


def check_fixed_sizes(plan: ParallelPlan, batch: int | None, seq: int | None,
                      batch_key: str, seq_key: str) -> None:
    """A global ``batch`` or sequence length ``seq`` the program cannot run: the model's code
    fixed that size of an input at the example's (``plan.fixed_sizes``; the compile warned)
    or bounds it (``plan.size_ranges``: a position table of 16 rows sliced by the length;
    where no op bounds it, named by the guards ``seq`` breaks: ``if i < T``), or
    ``seq`` or ``batch`` breaks a guard torch.export captured the graph under
    (``plan.size_guards``: nanoGPT's ``T != 64``).

    Raises:
        UserError: naming the flag or key, the value, the size compiled and the fix.
    """
    dp, m = plan.mesh["dp"], plan.microbatches

    def given(d: int) -> tuple:
        """The flag, the size's name and the value one microbatch on one dp rank gets."""
        if d == 0:
            return batch_key, "batch size", batch // (dp * m) if batch else None, batch
        return seq_key, "sequence length", seq, seq
    for name, d, size in plan.fixed_sizes:
        key, what, value, flag = given(d)
        if value and value != size:
            raise UserError(f"{key} {flag}: the program runs only the "
                            f"{what} {size} of input {name!r}, which the model's code fixes "
                            f"(a constant in the captured graph, or a condition torch.export "
                            f"guarded on it: a layer over that dim, a loop over it, a size "
                            f"turned into a Python number; report.md names it); use {size}, or "
                            f"size the model's code by the tensor and compile again")
    for name, d, low, high, where in plan.size_ranges:
        key, what, value, flag = given(d)
        if value and (value > (high or value) or (low > 2 and value < low)):
            per = f" ({value} per microbatch and dp rank)" if d == 0 else ""
            span = f"{low}..{high}" if high else f"at least {low}"
            broken = _broken_texts(plan, d, value)
            if not where and broken:  # no op bounds it: guards do (`if i < s`, zoo 24 F5)
                raise UserError(f"{key} {flag}{per}: torch.export captured input {name!r} "
                                f"under {broken} on its {what}, which {value} breaks: "
                                f"conditions the model's code sets (its Python control flow "
                                f"or an assert), and the program computes the model only "
                                f"where they hold ({span}, each condition met; report.md "
                                f"lists them); use such a {what}")
            raise UserError(f"{key} {flag}{per}: the model's code accepts the {what} {span} "
                            f"of input {name!r}{' (' + where + ')' if where else ''}: a bound in "
                            f"the captured graph (a position table sliced or looked up by it, "
                            f"an assert), which another size fails inside the forward; use "
                            f"a {what} in that range")
    for d in (0, 1):
        key, what, value, flag = given(d)
        broken = first_broken(plan.size_guards, d, value, plan.sequence_dims) if value else None
        if broken:
            name, _, size, text, _, excluded = broken
            raise UserError(f"{key} {flag}: torch.export captured input {name!r} under the "
                            f"condition `{text}` on its {what}, which {value} breaks (sizes "
                            f"from 2 to {max(4 * size, 256)} that break it: "
                            f"{spans_text(excluded) or 'none'}); the program computes the model "
                            f"only where it holds (the example's {size} does): use another "
                            f"{what}")


def _broken_texts(plan: ParallelPlan, d: int, value: int) -> str:
    """The guards on dim ``d`` that ``value`` breaks, as `a`, `b`; "" when none."""
    left, texts = list(plan.size_guards), []
    while True:
        guard = first_broken(left, d, value, plan.sequence_dims)
        if guard is None:
            return ", ".join(f"`{t}`" for t in texts)
        texts.append(guard[3])
        left = left[left.index(guard) + 1:]


def _resized(plan: ParallelPlan, example, batch: int | None, seq: int | None):
    """``example`` with dim 0 set to ``batch`` and dim 1 to ``seq`` (where given) in the
    inputs whose dim 1 the captured graph holds as a symbol and is the first such input's
    (the sequence; a (B, 5) feature input beside (B, T) token ids keeps its 5, Whisper's
    (B, 16 mel bins, frames) beside (B, 16) labels its 16: ``plan.static_dims``), and the
    other dims the graph holds as that sequence (a (B, S, S) mask: ``plan.sequence_dims``)."""
    if not batch and not seq:
        return example
    out = []
    flat = flatten(plan, example)
    names = plan.input_names or tuple(range(len(flat)))
    static = set(map(tuple, plan.static_dims))
    sequence = set(map(tuple, plan.sequence_dims))
    dynamic = [t.shape[1] for n, t in zip(names, flat) if t.dim() > 1 and (n, 1) not in static]
    length = dynamic[0] if dynamic else None  # the first sequence input's
    for name, t in zip(names, flat):
        shape = list(t.shape)
        if batch and shape and (name, 0) not in static:
            shape[0] = batch
        if seq and len(shape) > 1 and shape[1] == length and (name, 1) not in static:
            shape[1] = seq
        for k in range(2, len(shape)):  # a (B, S, S) mask's dim 2 (plan.sequence_dims)
            if seq and shape[k] == length and (name, k) in sequence:
                shape[k] = seq
        # the example's largest token id: synthetic_batches draws ids below it
        top = int(t.max()) if t.numel() and not t.is_floating_point() else 0
        out.append(torch.full(shape, top, dtype=t.dtype))
    return to_batch(plan, out)


def _concat(plan: ParallelPlan, batches: list):
    if len(batches) == 1:
        return batches[0]
    flat = [flatten(plan, b) for b in batches]
    return to_batch(plan, [torch.cat(parts) for parts in zip(*flat)])


class GlobalSource:
    """Global batches from an iterator (batches() or synthetic); this rank's dp slice."""

    def __init__(self, plan: ParallelPlan, iterator, ctx):
        self.plan, self.it, self.ctx, self.position, self.last_tokens = plan, iterator, ctx, 0, 0

    def seek(self, position: int) -> None:
        if position < self.position:
            raise ValueError("a batches() stream cannot go back")
        self.it = itertools.islice(self.it, position - self.position, None)
        self.position = position

    def next_step(self, accum: int):
        parts = []
        for _ in range(accum):
            batch = next(self.it, None)
            if batch is None:
                raise UserError(f"model.py's batches() ran out after {self.position} batches; "
                                f"lower --steps or yield more batches")
            self.position += 1
            _check_batch(self.plan, batch)
            self.last_tokens = _tokens(self.plan, batch)
            parts.append(dp_slice(self.plan, batch, self.ctx.dp_rank, self.ctx.device))
        return _concat(self.plan, parts)

    def tokens_per_step(self, accum: int) -> int:
        return self.last_tokens * accum


class TokenSource:
    """Batches of ``data:`` token windows; this rank reads only its rows."""

    def __init__(self, plan: ParallelPlan, data: dict, ctx, options, path, key: str, shuffle: bool,
                 model_module=None):
        if len(plan.input_names) != 1:
            raise DataError(f"{key}: the token data fills one input (token ids), but the model "
                            f"takes {len(plan.input_names)} ({', '.join(plan.input_names)}); "
                            f"write batches() in model.py instead")
        example = _example_shape(plan, model_module)
        seq = options.seq_len or data.get("seq_len") or example[1]
        batch = options.batch_size or data.get("batch_size") or example[0]
        if not seq or not batch:
            raise DataError(f"{key}: set data.seq_len and data.batch_size (example_inputs() gave "
                            f"no batch and sequence dims)")
        check_fixed_sizes(plan, batch, seq, "data.batch_size / --batch-size",
                          "data.seq_len / --seq-len")
        dp, m = plan.mesh["dp"], plan.microbatches
        if batch % (dp * m):
            raise DataError(f"{key}: the global batch size {batch} (data.batch_size or "
                            f"--batch-size) is not divisible by mesh.dp ({dp}) x "
                            f"pipeline.microbatches ({m}) = {dp * m}")
        self.plan, self.ctx, self.position = plan, ctx, 0
        self.data = TokenData(path, data.get("dtype", "uint16"), seq, batch, plan.seed, shuffle,
                              data.get("vocab_size"), key)

    def seek(self, position: int) -> None:
        self.position = position

    def batches(self) -> dict:
        """What one position counts: a batch of ``batch_size`` windows of ``seq_len`` tokens
        (saved with the position: another batch would skip or repeat data on resume)."""
        return {"batch_size": self.data.batch_size, "seq_len": self.data.seq_len}

    def next_step(self, accum: int):
        parts = []
        for _ in range(accum):
            rows = self.data.local_batch(self.position, self.ctx.dp_rank, self.plan.mesh["dp"])
            parts.append(to_batch(self.plan, [rows.to(self.ctx.device)]))
            self.position += 1
        return _concat(self.plan, parts)

    def tokens_per_step(self, accum: int) -> int:
        return self.data.batch_size * self.data.seq_len * accum


def _check_batch(plan: ParallelPlan, batch) -> None:
    """A batch of model.py's batches() the program can run (:func:`check_fixed_sizes`): a
    length the model's code fixed at the example's failed inside a stage's view on every
    rank (zoo 16 Z10, torchscale's chunkwise RetNet).

    Raises:
        UserError: naming batches(), the size it yielded and the one compiled.
    """
    flat = flatten(plan, batch)
    names = plan.input_names or tuple(range(len(flat)))
    # the sequence: dim 1 of the first input that holds one (symbolic, or fixed by the code;
    # not a feature input's static dim 1 beside token ids)
    fixed = {(f[0], f[1]) for f in plan.fixed_sizes}
    static = set(map(tuple, plan.static_dims)) - fixed
    rows = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim()), None)
    seq = next((t.shape[1] for n, t in zip(names, flat) if isinstance(t, torch.Tensor)
                and t.dim() > 1 and (n, 1) not in static), None)
    check_fixed_sizes(plan, rows, seq, "model.py's batches(): batch size",
                      "model.py's batches(): sequence length")


def _tokens(plan: ParallelPlan, batch) -> int:
    t = flatten(plan, batch)[0]
    return t.shape[0] * (t.shape[1] if t.dim() > 1 else 1)


def _example_shape(plan: ParallelPlan, model_module) -> list:
    """[batch, sequence] of example_inputs()' first input ([None, None] without model.py)."""
    if model_module is None:
        return [None, None]
    t = flatten(plan, model_module.example_inputs())[0]
    return [t.shape[0] if t.dim() else None, t.shape[1] if t.dim() > 1 else None]
