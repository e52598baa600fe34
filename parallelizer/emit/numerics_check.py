"""The numerics self-check: every tp rank of the emitted program run on real tensors in one
process and compared with the unmodified model, before OUT/ is written (issue 23).

The shape check (emit/rank_check.py) and the gradient accounting catch a wrong shape or a
gradient summed in the wrong place; a wrong value of the right shape (the pieces of a fused
q|k|v concatenated in another order, a missing sum) needs the values. So, on the example
batch, in the model's fp32:

- the unmodified model runs eagerly, forward and backward (:func:`reference`);
- every tp rank runs each stage's emitted module (``program/stage{i}.py``, the source run.py
  imports), stages chained in pipeline order on the whole batch (no microbatches), each
  rank holding its pieces of the tensors as the checkpoint writer cuts them
  (``checkpoint.slicing.local_piece`` from the plan's ``tp_dim`` and layout). The ranks are
  threads and the runtime's own tp operators communicate between them
  (emit/tp_threads.py). vocab_parallel outputs are gathered over tp as ``run.py`` returns
  them;
- both backward from the same seeded cotangent of every floating-point output (a fixed
  random direction, so every output's backward is exercised, not only what a loss reads);
- the program's gradients are synchronised as ``runtime/step.py`` does: a weight held by
  several stages summed over its copies, ``plan.grad_sync``'s ``replicated_heads`` runs over
  the ranks holding one kv head and its ``partial_tp`` parameters over all tp ranks;
- every output (a 0-dim one is the model's loss), every parameter gradient and every buffer
  the forward writes (BatchNorm's running statistics, sharded with its channels where they
  arrive sharded) is compared, each rank's piece against the same piece of the reference
  (which is the comparison of the gathered tensor, and also holds every copy of a replicated
  value to the reference).

Dropout is inactive and every other random op gives its fixed stand-in on both sides, as
under ``run.py --verify`` (``rng.dropout_active(False)`` in the program,
``rng.EagerDropoutOff`` and ``rng.RandomStandIns`` in the model). An element differs when
``|got - want| > ATOL * max(1, max|want|) + RTOL * |want|`` (the absolute part scaled by the
tensor's magnitude: a gradient summed over many tokens keeps fp32's relative rounding);
a gradient the model rounds to bfloat16 / float16 (a weight read through a fake
quantisation) is compared within that dtype's rounding, and a model that computes in one of
them (``F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))``) within a few units of its
rounding throughout (:mod:`.numerics_compare`). Past that, the model's same step in float64
(:func:`_with_rounding`) adds 8 x its own rounding error of each tensor, as ``run.py
--verify`` allows, before a difference counts. A difference is a PlanError naming the first
tensor that differs (output index, parameter FQN or buffer) and its max abs error: a bug in
parallelizer, with mesh.tp=1 as the workaround (mesh.pp=1 at tp 1: the stages chained on one
rank check the pipeline split, where a value a later stage recomputes could differ).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from ..checkpoint.slicing import local_piece
from ..errors import CaptureError, PlanError
from ..frontend.branches import check_step_branches
from ..frontend.capture import eager_message, split_args
from ..frontend.custom_functions import checkpoint_off
from ..frontend.model_file import headline
from ..frontend.module_state import state_kept
from ..plan.dtypes import differentiable
from ..plan.layouts import copied_heads, copied_runs
from ..runtime import rng
from ..runtime.batching import flatten
from ..runtime.stage_builder import stage_class_from_source
from ..runtime.verify import fp64_agrees
from ..runtime.vocab import gather_from_tp_region
from .reference import fp64_copy, max_abs_diff, to_fp64, unchanged
from .numerics_compare import (ATOL, BUG, FIX, compare_buffers, compare_grads,
                               compare_outputs, tolerance)
from .tp_threads import rank_threads, run_ranks


@dataclass(frozen=True)
class Reference:
    """The unmodified model's flat outputs, the cotangent given to each (None: not a
    floating-point tensor), its parameters' gradients (canonical FQN -> tensor or None) and
    the buffers its forward wrote (FQN -> the value after it); ``noise``: ("output", i) /
    ("grad", fqn) / ("buffer", fqn) -> the max difference of that tensor from the same step
    in float64 (:func:`_with_rounding`; empty: none allowed)."""
    outputs: list
    cotangents: list
    grads: dict
    buffers: dict
    noise: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Checked:
    """What :func:`check_numerics` compared, for the compile's note."""
    tp: int
    outputs: int
    gradients: int
    output_err: float
    gradient_err: float
    margin: float  # the largest |got - want| / tolerance of an element (< 1: passed)
    seconds: float
    coarse: str = ""  # the coarser float dtype the model computes in ("" for none)
    buffers: int = 0  # buffers the forward writes, compared after it
    rounding: bool = False  # the model's own float64 rounding error was allowed

    def note(self) -> str:
        return (f"self-check: {self.tp} tp rank(s) of the program against the model on the "
                f"example batch (fp32): {self.outputs} output(s) max abs err "
                f"{self.output_err:.2g}, {self.gradients} gradient(s) max abs err "
                f"{self.gradient_err:.2g}"
                + (f", {self.buffers} buffer(s) the forward writes" if self.buffers else "")
                + f", at most {100 * self.margin:.2g}% of the tolerance"
                + (" and 8 x the model's own rounding error (its float64 step)"
                   if self.rounding else "")
                + (f" ({self.coarse}'s, the dtype the model computes in)" if self.coarse else "")
                + f" ({self.seconds:.1f} s)")


@dataclass(frozen=True)
class When:
    """Whether the self-check runs (:func:`when`); if not, why (``skipped``: "" where no note
    is due, at ``mode`` false or tp = pp = 1) and whether ``--self-check`` would run it
    anyway (a size limit, not a blocker)."""
    run: bool
    skipped: str = ""
    forceable: bool = False

    @property
    def note(self) -> str:
        """The compile's note about a skipped check ("" for none)."""
        if not self.skipped:
            return ""
        return (f"self-check: skipped ({self.skipped}"
                f"{'; --self-check forces it' if self.forceable else ''})")


def when(cfg, plan, model: torch.nn.Module, batch, weights: bool) -> When:
    """Whether to run the self-check under the spec's ``self_check`` section ``cfg``, and why
    not when ``auto`` skips it at mesh.tp > 1 or mesh.pp > 1.

    Raises:
        PlanError: ``self_check.mode`` true on a program it cannot check (no weights, a
            non-fp32 parameter, mesh.ep > 1), naming the reason.
    """
    mode = cfg.mode
    if mode is False:
        return When(False)
    blocker = _blocker(plan, model, weights)
    if mode is True:
        if blocker:
            raise PlanError(f"self_check.mode=true (--self-check) cannot run: {blocker}; drop "
                            f"--self-check, or set self_check.mode=auto to skip it then")
        return When(True)
    if plan.mesh["tp"] == 1 and plan.mesh["pp"] == 1:
        return When(False)
    if blocker:
        return When(False, blocker)
    params = sum(p.numel() for p in model.parameters())
    largest = max((t.numel() for t in flatten(plan, batch) if isinstance(t, torch.Tensor)),
                  default=0)
    gflops = step_flops(plan) / 1e9
    if params > cfg.max_params:
        blocker = f"{params:,} parameters > self_check.max_params ({cfg.max_params:,})"
    elif gflops > cfg.max_gflops:
        blocker = (f"a step of the example batch costs {gflops:,.0f} GFLOPs > "
                   f"self_check.max_gflops ({cfg.max_gflops:g})")
    elif cfg.max_input_elements is not None and largest > cfg.max_input_elements:
        blocker = (f"the example batch's largest input has {largest:,} elements > "
                   f"self_check.max_input_elements ({cfg.max_input_elements:,})")
    return When(not blocker, blocker, forceable=bool(blocker))


def step_flops(plan) -> int:
    """Forward + backward FLOPs of one step of the example batch, from the plan's cost-model
    units (``plan.structure``: torch.utils.flop_counter's counts the pipeline planner
    weighs); 0 where the plan carries none."""
    st = plan.structure
    return sum(st.get("block_costs", ())) + st.get("pre_cost", 0) + st.get("post_cost", 0)


def _blocker(plan, model: torch.nn.Module, weights: bool) -> str:
    if not weights:
        return "the model has no weights (--no-weights or a meta-device model)"
    if plan.ep > 1:
        return f"mesh.ep={plan.ep} (expert parallelism is not simulated, only tp ranks)"
    other = next((n for n, p in model.named_parameters() if p.is_floating_point()
                  and p.dtype != torch.float32), None)
    if other is not None:
        return (f"it compares in fp32 and {other} is "
                f"{str(model.get_parameter(other).dtype).replace('torch.', '')}")
    return ""


def check_numerics(plan, sources: dict, model: torch.nn.Module, batch, state: dict,
                   seed: int = 0, model_file=None) -> Checked:
    """Run every tp rank of the program and the model on ``batch`` and compare them.

    Args:
        sources: the emitted sources (``program/stage{i}.py``).
        model: the unmodified model (not changed: its gradients are returned, not
            accumulated, and its buffers restored).
        state: canonical FQN -> full tensor, what the checkpoint writer cuts.

    Raises:
        PlanError: an output or gradient differs (naming it and the max abs error), or the
            program fails on a rank. CaptureError: the model itself fails on ``batch``
            (``model_file`` names it).
    """
    start = time.perf_counter()
    tp = plan.mesh["tp"]
    want = model_reference(model, batch, seed, model_file)
    classes = _stage_classes(plan, sources)
    try:
        modules = [[_rank_stage(classes[st.index], plan, state, tp, r) for st in plan.stages]
                   for r in range(tp)]
    finally:
        for st in plan.stages:
            sys.modules.pop(f"parallelizer_program_stage{st.index}", None)
    outputs = _run_program(plan, modules, flatten(plan, batch), want.cotangents)
    grads = [_rank_grads(plan, mods) for mods in modules]
    _sync_grads(plan, grads, tp)
    tol = tolerance(sources)
    margin = [0.0]
    try:
        out_err, grad_err = _compared(plan, outputs, grads, modules, want, margin, tol)
    except PlanError:  # beyond the fixed tolerance: within the model's own rounding?
        wide = _with_rounding(model, batch, want, seed)
        if wide is None:
            raise
        want, margin = wide, [0.0]
        out_err, grad_err = _compared(plan, outputs, grads, modules, want, margin, tol)
    return Checked(tp, len(want.outputs), len([g for g in want.grads.values() if g is not None]),
                   out_err, grad_err, margin[0], time.perf_counter() - start, tol.coarse,
                   len(want.buffers), bool(want.noise))


def _compared(plan, outputs: list, grads: list, modules: list, want: Reference, margin: list,
              tol) -> tuple[float, float]:
    """(max output error, max gradient error); PlanError at the first tensor that differs."""
    tp = plan.mesh["tp"]
    out_err = compare_outputs(outputs, want, margin, tol)
    grad_err = compare_grads(plan, grads, want, tp, margin, tol)
    compare_buffers(plan, modules, want, tp, margin, tol)
    return out_err, grad_err


def _with_rounding(model: torch.nn.Module, batch, want: Reference, seed: int):
    """``want`` with the model's own rounding error of each tensor: the same step (same
    cotangents) of a float64 copy, as ``emit/reference.py`` measures it for ``run.py
    --verify``. Only asked for after a difference beyond the fixed tolerance, so a
    well-conditioned model pays nothing; None when the float64 step fails (an op without a
    float64 kernel) or the model is not fp32."""
    wide = fp64_copy(model) if all(p.dtype == torch.float32 for p in model.parameters()) \
        else None
    if wide is None:
        return None
    _check_repeatable(model, batch, want, seed)
    try:
        exact = reference(wide, to_fp64(batch), seed,
                          [c.double() if c is not None else None for c in want.cotangents])
    except Exception:  # noqa: BLE001  the allowance is optional; the mismatch stands
        return None
    if not fp64_agrees(_dot(want.outputs, want.cotangents), _dot(exact.outputs,
                                                                   exact.cotangents)):
        return None  # another function in float64 (dtype-dependent code): no rounding
    noise = {}
    for i, (a, b) in enumerate(zip(want.outputs, exact.outputs)):
        noise[("output", i)] = _diff(a, b)
    for kind, mine, wide in (("grad", want.grads, exact.grads),
                             ("buffer", want.buffers, exact.buffers)):
        for k, a in mine.items():
            noise[(kind, k)] = _diff(a, wide.get(k))
    return replace(want, noise=noise)


def _check_repeatable(model: torch.nn.Module, batch, want: Reference, seed: int) -> None:
    """The model's step again from another state of torch's generator: a random op without
    a stand-in (``rng.RandomStandIns``) draws other values, and the float64 step's difference
    from ``want`` would be that draw, not rounding, and let a wrong program through
    (diffusers' ``torch.randn(..., generator=None)`` had no stand-in: the self-check passed a
    program that ``--verify`` failed by 0.16, zoo 13 Z17).

    Raises:
        PlanError: the two steps differ, naming the first tensor and the difference.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7919)
        again = reference(model, batch, seed, want.cotangents)
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(want.outputs, again.outputs))]
    pairs += [(f"the gradient of {k}", a, again.grads.get(k)) for k, a in want.grads.items()]
    for what, a, b in pairs:
        d = _diff(a, b)  # 0 where either is no floating tensor (a parameter without gradient)
        if d and d > ATOL * max(1.0, float(a.abs().max())):
            raise PlanError(
                f"{BUG}the unmodified model gives another {what} when torch's generator starts "
                f"elsewhere (max abs difference {d:.3g}): it draws random numbers outside the "
                f"ops the self-check and --verify replace by fixed stand-ins, so no program can "
                f"be compared with it{FIX}")


def _dot(outputs: list, cotangents: list) -> float:
    """sum(output * cotangent): the scalar whose gradient the step computes, its loss."""
    return sum(float((o.double() * c.double()).sum()) for o, c in zip(outputs, cotangents)
               if isinstance(o, torch.Tensor) and c is not None)


def _diff(a, b) -> float:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or not a.is_floating_point() or a.shape != b.shape:
        return 0.0
    return max_abs_diff(a, b)


def model_reference(model: torch.nn.Module, batch, seed: int = 0, model_file=None) -> Reference:
    """:func:`reference`, where the unmodified model failing by itself is the user's error: a
    compile check that fails on the program runs this first (a ReLU output the model
    multiplies in place through a slice: autograd refuses its backward eagerly too).

    Raises:
        CaptureError: the model's own failure, with its line (``eager_message``).
    """
    try:
        return reference(model, batch, seed)
    except Exception as e:  # the model as it is, not the program: the user's to fix
        raise CaptureError(eager_message(e, model_file or Path("<in-memory model>"))) from e


def reference(model: torch.nn.Module, batch, seed: int = 0, given=None) -> Reference:
    """The model's forward on ``batch`` (dropout off, random ops on their stand-ins, as
    ``emit/reference.py`` runs it) and the gradients of its parameters for
    a seeded standard normal cotangent on every floating-point output (``given``: these
    cotangents instead)."""
    args, kwargs = split_args(batch)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with checkpoint_off(), state_kept(model, tensors=False):  # the backward reruns nothing
            with torch.random.fork_rng(devices=[]), rng.EagerDropoutOff(), rng.RandomStandIns():
                flat, _ = tree_flatten(model(*args, **kwargs))
            # the outputs autograd tracks in the model get a cotangent in the program too
            cot = [c if c is not None and o.requires_grad else None
                   for o, c in zip(flat, given if given is not None else cotangents(flat, seed))]
            pairs = [(o, c) for o, c in zip(flat, cot) if c is not None]
            grads = dict.fromkeys(params)
            if pairs and params:
                found = torch.autograd.grad([o for o, _ in pairs], list(params.values()),
                                            [c for _, c in pairs], allow_unused=True)
                grads = dict(zip(params, found))
        # a buffer the forward registers (a cache: x-transformers' ALiBi bias) is no state
        # the program writes
        written = {n: b.detach().clone() for n, b in model.named_buffers()
                   if n in saved and not unchanged(b, saved[n])}
    finally:
        # train-mode running statistics as they were; after the backward, which may read
        # a buffer the forward saved (Gemma's embedding normalizer)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved and not unchanged(b, saved[n]):
                    b.copy_(saved[n])
    return Reference([o.detach() if isinstance(o, torch.Tensor) else o for o in flat], cot,
                     grads, written)


def cotangents(flat: list, seed: int) -> list:
    """A standard normal tensor like each floating-point (or complex) output, seeded by
    ``seed`` and the output's index; None for the others."""
    out = []
    for i, o in enumerate(flat):
        if isinstance(o, torch.Tensor) and differentiable(o.dtype):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            out.append(torch.randn(o.shape, generator=g, dtype=o.dtype))
        else:
            out.append(None)
    return out


def _stage_classes(plan, sources: dict) -> dict:
    return {st.index: stage_class_from_source(sources[f"program/{st.module}.py"], st.index,
                                              f"<numerics self-check of program/{st.module}.py>")
            for st in plan.stages}


@torch.no_grad()
def _rank_stage(cls, plan, state: dict, tp: int, rank: int) -> torch.nn.Module:
    """Stage module of ``cls`` holding tp rank ``rank``'s pieces of ``state``."""
    module = cls("cpu")
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        fqn = plan.aliases.get(name, name)
        if fqn not in state or fqn not in plan.tensors:
            raise PlanError(f"{BUG}the program's tensor {name} is not a tensor of the plan "
                            f"(numerics self-check){FIX}")
        t.copy_(local_piece(state[fqn].detach(), plan.tensors[fqn], tp, rank))
    return module


def _run_program(plan, modules: list, flat_in: list, cot: list) -> list:
    """Each rank's flat outputs (vocab_parallel ones gathered), after its backward from
    ``cot``. Raises PlanError when a rank fails."""
    tp, vocab = plan.mesh["tp"], dict(plan.vocab_outputs)
    where = ["forward of stage 0"] * tp

    def work(rank: int) -> list:
        inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat_in]
        for st, module in zip(plan.stages, modules[rank]):
            where[rank] = f"forward of stage {st.index}"
            out = module(*inputs)
            inputs = list(out) if isinstance(out, (tuple, list)) else [out]
        whole = [gather_from_tp_region(t, vocab[i]) if i in vocab else t
                 for i, t in enumerate(inputs)]
        if len(whole) != len(cot):
            raise PlanError(f"{BUG}the program returns {len(whole)} outputs, the model "
                            f"{len(cot)} (numerics self-check){FIX}")
        pairs = [(o, c) for o, c in zip(whole, cot) if c is not None and
                 isinstance(o, torch.Tensor) and o.requires_grad and o.shape == c.shape]
        where[rank] = "backward"
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in whole]

    with rank_threads(tp) as ex, rng.dropout_active(False):
        try:
            return run_ranks(ex, work)
        except PlanError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure here is the compiler's
            check_step_branches(e)  # but a branch the example decided: the model's
            r = getattr(e, "tp_rank", 0)
            raise PlanError(f"{BUG}the program fails in the numerics self-check on tp rank "
                            f"{r} in the {where[r]}: {type(e).__name__}: {headline(e, '')}"
                            f"{FIX}") from e


def _rank_grads(plan, modules: list) -> dict:
    """Canonical FQN -> this rank's gradient, summed over the stages holding a copy (a tied
    weight across stages, as runtime/step.py sums them); None when no copy got one."""
    out: dict = {}
    for module in modules:
        for name, p in module.named_parameters():
            fqn = plan.aliases.get(name, name)
            if not p.requires_grad:
                continue
            g = p.grad  # the modules are this check's own: their gradients can be summed into
            if fqn not in out or out[fqn] is None:
                out[fqn] = g
            elif g is not None:
                out[fqn] = out[fqn] + g
    return out


def _sync_grads(plan, grads: list, tp: int) -> None:
    """``plan.grad_sync`` over the tp ranks (those of pp rank 0, dp rank 0: global ranks
    0..tp-1), in place: copied kv-head runs summed over the ranks holding the head,
    ``partial_tp`` parameters over all tp ranks (runtime/step.py ``_sum_shared_grads``)."""
    for entry in plan.grad_sync:
        groups = [g for g in entry["ranks"] if all(r < tp for r in g)]
        if entry["kind"] == "partial_tp":
            for fqn in entry["key"]:
                _sum(grads, groups, fqn, None)
        elif entry["kind"] == "replicated_heads":
            for fqn, tplan in plan.tensors.items():
                if entry["key"] not in copied_heads(tplan.layout):
                    continue
                d = tplan.tp_dim % len(tplan.shape)
                for offset, length, heads in copied_runs(tplan.shape[d], tplan.layout, tp):
                    if heads == entry["key"]:
                        _sum(grads, groups, fqn, (d, offset, length))


def _sum(grads: list, groups: list, fqn: str, run) -> None:
    for group in groups:
        parts = [grads[r].get(fqn) for r in group]
        if any(p is None for p in parts):
            continue
        if run is not None:
            parts = [p.narrow(*run) for p in parts]
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        for p in parts:
            p.copy_(total)
