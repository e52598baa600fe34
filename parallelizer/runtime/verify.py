"""``run.py --verify``: one step of the parallel program against the unmodified model.

Forward, backward and one optimizer step on the reference inputs; loss, outputs, gradients
and updated parameters, and the buffers the forward writes where the batch runs in one piece
(each gathered back to full shape) are compared with
``reference.safetensors`` in fp32 with the spec's atol/rtol, the atol scaled by each
tensor's magnitude (:func:`within`, the compile's self-check's rule). Gradients are compared
directly: AdamW's first step is nearly invariant to a uniform gradient scale, so checking
only the updated parameters would miss a wrongly scaled gradient. The tp ranks' copies of a
replicated kv head (layout ``replicated_heads``) must agree, in gradients and parameters.
Dropout is inactive in the step, as it was in the reference (``emit/reference.py``), and
every other random op (a drop path's ``torch.rand``, Gumbel noise) gives the same fixed
stand-in there as here (``runtime.rng.RandomStandIns``), so the comparison stays exact; the
report says so when the model has either.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..plan.parallel_plan import ParallelPlan
from .batching import dp_slice, to_batch
from ..plan.layouts import copied_heads
from ..checkpoint.format import load_tensors
from .gather import copies_max_diff, full_tensor
from .data_parallel import make_stage_optimizer
from .rng import dropout_active
from .setup import RankContext
from .stage_builder import local_tensor
from .step import StepRunner

CATEGORIES = ("loss", "outputs", "gradients", "parameters", "buffers")
# (atol, rtol) floor by the dtype the program computes in (mixed_precision.param_dtype); the
# reference is the fp32 model. About 2-4 ulp at |x| ~ 1: bf16 has 8 mantissa bits (eps
# 7.8e-3), fp16 11 (eps 9.8e-4). fp32 uses verify.atol / verify.rtol as given.
DTYPE_TOLERANCE = {"fp32": (0.0, 0.0), "fp16": (5e-3, 5e-3), "bf16": (3e-2, 3e-2)}


def tolerances(vcfg: dict, param_dtype: str, compression: str = "none") -> tuple[float, float]:
    """(atol, rtol) of --verify: the spec's, raised to the floor of ``param_dtype`` and of an
    fp16/bf16 gradient compression (gradients rounded to that dtype before the reduction)."""
    floors = [DTYPE_TOLERANCE[param_dtype]] + ([DTYPE_TOLERANCE[compression]] if compression in DTYPE_TOLERANCE else [])
    return max([vcfg["atol"]] + [a for a, _ in floors]), max([vcfg["rtol"]] + [r for _, r in floors])


def not_sample_mean(ref: dict, dp: int, microbatches: int, atol: float, rtol: float) -> str:
    """Why a data-parallel program cannot equal the whole-batch reference ``ref`` when its
    loss over the program's row chunks (``loss.chunked``, emit/reference.py ``chunked_step``)
    is not its whole-batch loss within ``atol`` / ``rtol``, or a gradient of it is not
    (``chunked.grad.NAME``: the largest difference, emit/reference.py ``gradient_gap``), and
    what to verify instead; '' when both are (or ``ref`` has no chunked loss)."""
    chunked = ref.get("loss.chunked")
    gap = next(((k.removeprefix("chunked.grad."), float(v)) for k, v in ref.items()
                if k.startswith("chunked.grad.")), None)
    if chunked is None:
        return ""
    same_loss = torch.allclose(chunked, ref["loss"].float(), atol=atol, rtol=rtol)
    if gap is None and same_loss:
        return ""
    chunked, whole = chunked.item(), ref["loss"].item()
    grad = "" if gap is None else (f"; the gradient of {gap[0]} differs from the whole batch's "
                                   f"by up to {gap[1]:.3g}")
    what = "its gradients are" if same_loss else "the loss is"
    return (f"{what} not a mean over samples: on the batch cut into mesh.dp ({dp}) x "
            f"pipeline.microbatches ({microbatches}) chunks, as the program computes it, the "
            f"unmodified model's loss averages to {chunked:.6f}, on the whole batch it is "
            f"{whole:.6f}{grad} (a router auxiliary loss, batch statistics such as BatchNorm's, an "
            f"embedding's scale_grad_by_freq (each row's gradient divided by its token's count "
            f"in the chunk), a mean "
            f"over tokens with ignored labels (-100) spread unevenly over the chunks that the "
            f"compile could not divide by the whole batch's count: one in loss_fn, one whose "
            f"labels are written in place (mask them with torch.where), or one not linear in "
            f"the loss, docs/models.md); every "
            f"data-parallel program, as DDP or FSDP training, computes the chunks' mean, so "
            f"run.py --verify against the whole-batch reference differs by that much. Verify "
            f"the layout at mesh.dp=1 mesh.pp=1 pipeline.microbatches=1 (tp alone; a pipeline "
            f"needs pipeline.microbatches >= mesh.pp) to compare exactly")


def chunks_line(ref: dict, dp: int, microbatches: int, vcfg: dict, loss=None,
                param_dtype: str = "fp32") -> str:
    """What a failed --verify's chunked reference loss says: :func:`not_sample_mean`, or that
    the loss is a mean over samples. Both losses are the fp32 model's, so they are compared
    at fp32's tolerances (``verify.atol`` / ``rtol``) whatever ``param_dtype`` the program
    runs: at bf16's a BatchNorm's per-chunk statistics passed for a mean over samples.
    ``loss``: the program's; where it is not the chunks' loss either (at ``param_dtype``'s
    tolerances) the chunking does not explain the failure, and the line says so first."""
    why = not_sample_mean(ref, dp, microbatches, *tolerances(vcfg, "fp32"))
    chunked = ref.get("loss.chunked")
    if why and loss is not None and chunked is not None and not torch.allclose(
            loss.detach().float().cpu(), chunked.float(), *reversed(tolerances(vcfg, param_dtype))):
        why = (f"the program's loss {loss.item():.6f} is not the unmodified model's on the "
               f"same chunks either ({chunked.item():.6f}), so the chunking does not explain "
               f"the difference: the program computes something else (report it, with this "
               f"output). Besides, " + why)
    return why or ("the unmodified model's loss over this program's dp x microbatch chunks "
                   "averages to its whole-batch loss, so the loss is a mean over samples")


def compression_rule(plan: ParallelPlan) -> str:
    """How --verify judges gradients and parameters under ``plan.compression`` (printed)."""
    c = plan.compression
    if c.get("method") == "powersgd":
        return (f"powersgd: the verify step is step 1 of the uncompressed warm-up (start_iter="
                f"{c['start_iter']} >= 2), so the tolerances above apply")
    if c.get("method") == "topk":
        return (f"topk ratio {c['ratio']}: the reduced gradient is mean_i(g_i - r_i), r_i what rank "
                f"i did not send; gradients + mean_i r_i (all-reduced residuals) and, under sgd, "
                f"parameters - lr mean_i r_i are compared at the tolerances above (adamw: "
                f"||p - p_ref|| <= 2 lr sqrt(n) + atol)")
    return ""


def finite_part(got: torch.Tensor, want: torch.Tensor):
    """``(got, want)`` at the elements where ``want`` is finite, or None when ``got`` differs
    where it is not. A model whose own gradient is nan (a parameter multiplied into a -inf
    mask: 0 x inf in its backward) is matched by the same nan, not counted an error; the
    compile warns about it (``emit/reference.py`` :func:`nonfinite_warnings`)."""
    finite = torch.isfinite(want)
    if bool(finite.all()):
        return got, want
    same = (got == want) | (got.isnan() & want.isnan())
    if not bool(same[~finite].all()):
        return None
    return got[finite], want[finite]


# --verify allows this many times the unmodified model's own rounding error of a tensor
# (emit/reference.py rounding_noise: its step in its dtype against the same step in
# float64): the program computes the same sums in another order and errs about as much;
# the margin covers a program's error up to several times the reference's
NOISE_FACTOR = 8
# a tensor whose own rounding error is this share of its magnitude is reported: little of
# its value is checked (a wrong program may hide in it)
ILL_CONDITIONED = 0.1
# the float64 step's loss differs from an fp32 model's by at most this share of max(1,
# |loss|) when only rounding tells them apart (orders above fp32's); beyond it the float64
# copy computes another function (code that depends on the dtype: nn.MultiheadAttention
# given a float32 attn_mask beside float64 queries, zoo 25 F2), and its differences are no
# rounding error to allow: they allowed a quarter of every gradient, and --verify said PASS
FP64_AGREES = 1e-4


def fp64_agrees(got: float, exact: float) -> bool:
    """Whether an fp32 model's scalar ``got`` (its loss) is the float64 step's ``exact``
    up to rounding (:data:`FP64_AGREES`); a nan on either side is no agreement."""
    return abs(got - exact) <= FP64_AGREES * max(1.0, abs(exact))


def within(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
           noise: float = 0.0) -> bool:
    """Every element ``|got - want| <= atol * max(1, max|want|) + NOISE_FACTOR * noise +
    rtol * |want|``: the absolute part scaled by the tensor's magnitude, since a value summed
    from large terms (a class token's gradient over every position and block, magnitude 200)
    keeps fp32's rounding of those terms, which an element near zero cannot meet at a fixed
    atol; ``noise``: the model's own rounding error of this tensor (:data:`NOISE_FACTOR`).
    A wrongly scaled or missing contribution is still far outside it. Where ``want`` is nan
    or inf, ``got`` must be the same (:func:`finite_part`)."""
    pair = finite_part(got, want)
    if pair is None:
        return False
    got, want = pair
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    return torch.allclose(got, want, atol=atol * scale + NOISE_FACTOR * noise, rtol=rtol)


class _Tally:
    def __init__(self, atol, rtol):
        self.atol, self.rtol = atol, rtol
        self.err = {c: 0.0 for c in CATEGORIES}
        self.bad = {c: 0 for c in CATEGORIES}
        self.count = {c: 0 for c in CATEGORIES}
        self.worst = {c: "" for c in CATEGORIES}
        self.noisy: dict = {}  # tensor -> (its own rounding error, its magnitude)
        self.noise = False  # the reference carries its rounding errors

    def mismatch(self, cat, what):
        """A tensor that cannot be compared (a shape, or a gradient only one side has):
        counted, named as the worst, error inf (a NaN would hide it behind the others)."""
        self.bad[cat] += 1
        self.worst[cat], self.err[cat] = what, float("inf")

    def add(self, cat, name, got, want, bound=None, noise=None):
        """Compare elementwise at (atol, rtol) and ``noise`` (the reference's own rounding
        error, :func:`within`), or, with ``bound``, by the 2-norm of the difference against
        ``bound`` + atol (Top-K's rule, :func:`compression_rule`)."""
        got, want = got.detach().float().cpu(), want.float()
        noise = 0.0 if noise is None else float(noise)
        finite = want[torch.isfinite(want)]
        magnitude = finite.abs().max().item() if finite.numel() else 0.0
        if noise > ILL_CONDITIONED * magnitude and noise > 0:
            self.noisy[f"{cat[:-1]} {name}"] = (noise, magnitude)
        if got.shape != want.shape:
            self.mismatch(cat, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            return
        pair = finite_part(got, want)
        e = float("inf") if pair is None else \
            (pair[0] - pair[1]).abs().max().item() if pair[1].numel() else 0.0
        if e != e:  # a nan in the program where the reference is finite: never below another
            e, name = float("inf"), f"{name} (nan where the reference is finite)"
        self.count[cat] += 1
        if e > self.err[cat]:
            self.err[cat], self.worst[cat] = e, name
        ok = ((pair is not None and (pair[0] - pair[1]).norm().item() <= bound + self.atol)
              if bound is not None else within(got, want, self.atol, self.rtol, noise))
        if not ok:
            self.bad[cat] += 1


def run_verify(out_dir: Path, plan: ParallelPlan, spec: dict, stage, ctx: RankContext, loss_fn) -> int:
    ref = load_tensors(Path(out_dir) / "reference.safetensors")
    batch = to_batch(plan, [ref[f"input.{n}"] for n in plan.input_names])
    local = dp_slice(plan, batch, ctx.dp_rank, ctx.device)
    vcfg, ocfg = spec["verify"], spec["optimizer"]
    tally = _Tally(*tolerances(vcfg, plan.param_dtype, plan.compression.get("method", "none")))
    runner = StepRunner(stage, plan, ctx, loss_fn)
    opt = make_stage_optimizer(stage.parameters(), vcfg["optimizer"], ocfg["lr"], ocfg["weight_decay"],
                               plan.zero_stage, ctx)
    opt.zero_grad(set_to_none=True)
    with dropout_active(False):
        loss, outputs = runner.step(local)
        if outputs is not None:
            outputs = runner.whole_outputs(outputs)
    # a one-element loss of shape (1,) (a loss_fn adding a (1,) auxiliary loss) is the
    # reference's 0-dim one (emit/reference.py reshapes it so)
    loss = loss.reshape(()) if loss.numel() == 1 else loss
    tally.add("loss", "loss", loss, ref["loss"], noise=ref.get("noise.loss"))
    tally.noise = any(k.startswith("noise.") for k in ref)
    skipped = []
    if outputs is not None:
        rows = ref[f"input.{plan.input_names[0]}"].shape[0]
        for i, out in enumerate(outputs):
            if f"output.{i}" not in ref:  # a None leaf of the model's output
                continue
            if i in plan.scalar_outputs:  # a loss: the mean over microbatches and dp ranks
                tally.add("outputs", f"output.{i}", _dp_mean(out, plan, ctx), ref[f"output.{i}"],
                          noise=ref.get(f"noise.output.{i}"))
                continue
            want = _output_share(ref[f"output.{i}"], rows, plan, ctx.dp_rank)
            if want is None:
                skipped.append(f"output.{i} {tuple(ref[f'output.{i}'].shape)}")
            else:
                tally.add("outputs", f"output.{i}", out, want, noise=ref.get(f"noise.output.{i}"))
    _unheld_gradients(tally, plan, ref)
    dropped = _mean_residuals(stage, ctx, runner) if plan.compression.get("method") == "topk" else {}
    _compare_tensors(tally, "gradients", "grad", stage, plan, ctx, ref,
                     lambda p: p.grad if p.grad is None or id(p) not in dropped else p.grad + dropped[id(p)])
    opt.step()
    lr, sgd = ocfg["lr"], vcfg["optimizer"] == "sgd"
    param_bound = (lambda fqn, want: 2 * lr * want.numel() ** 0.5) if dropped and not sgd else None
    _compare_tensors(tally, "parameters", "param", stage, plan, ctx, ref,
                     lambda p: p - lr * dropped[id(p)] if sgd and id(p) in dropped else p, param_bound)
    _compare_buffers(tally, stage, plan, ctx, ref)
    return _report(tally, plan, vcfg, loss, ref, ctx, skipped)


def unheld_gradients(ref: dict, plan: ParallelPlan) -> list[str]:
    """The parameters ``ref`` has a gradient for that no tensor of ``plan`` (or alias of
    one) holds: the program would never train them."""
    held = set(plan.tensors) | set(plan.aliases)
    return sorted(k.removeprefix("grad.") for k in ref
                  if k.startswith("grad.") and k.removeprefix("grad.") not in held)


def _unheld_gradients(tally, plan: ParallelPlan, ref: dict) -> None:
    """A gradient the reference has for a parameter no stage of the program holds: it
    would never train (the stages' own parameters are compared one by one)."""
    for fqn in unheld_gradients(ref, plan):
        tally.mismatch("gradients", f"{fqn}: a gradient in the reference, held by no stage "
                                    f"of the program")


def _compare_buffers(tally, stage, plan: ParallelPlan, ctx: RankContext, ref: dict) -> None:
    """The buffers the forward wrote (BatchNorm's running statistics; the reference's
    ``buffer.FQN``), gathered to full shape. Only when the batch runs in one piece (dp =
    microbatches = 1): else each chunk updates them from its own rows, as DDP and a pipeline
    do, which no whole-batch reference can equal. Collective over tp, in every rank's order of
    the stage's buffers."""
    if plan.mesh["dp"] * plan.microbatches != 1:
        return
    for name, buf in stage.named_buffers():
        fqn = plan.aliases.get(name, name)
        want = ref.get(f"buffer.{fqn}")
        if want is not None and fqn in plan.tensors:
            full = full_tensor(buf, plan.tensors[fqn], ctx, plan.mesh["tp"])
            tally.add("buffers", name, full, want, noise=ref.get(f"noise.buffer.{fqn}"))


def _mean_residuals(stage, ctx: RankContext, runner: StepRunner) -> dict:
    """Top-K: ``{id(parameter): mean over the reducing ranks of what they did not send}``
    (a DTensor under FSDP2, like ``.grad``), then summed over tied copies and kv-head copies
    as the step sums the gradients. Collective over the compression's group."""
    comp = ctx.compression
    mine, out = comp.residuals(), {}
    # FSDP2 under a schedule reduces (and runs the hook) on the sum over microbatches;
    # the schedule divides the gradients by their number afterwards (scale_grads)
    plan = runner.plan
    scale = plan.microbatches if plan.mesh["pp"] > 1 and plan.zero_stage >= 2 else 1
    for p in stage.parameters():
        if p.grad is None:
            continue
        r = mine.get(id(p))
        r = torch.zeros_like(p.grad) if r is None else r.detach().clone()
        dist.all_reduce(local_tensor(r), group=comp.group)
        local_tensor(r).div_(dist.get_world_size(comp.group) * scale)
        out[id(p)] = r
    runner._sync_tied_grads(lambda p: out.get(id(p)))
    runner._sum_shared_grads(lambda p: out.get(id(p)))
    return out


def _output_share(want: torch.Tensor, rows: int, plan: ParallelPlan, dp_rank: int):
    """This rank's part of a reference output: its data-parallel rows when dim 0 is the batch;
    the whole output when the step runs the batch in one piece (dp = pp = 1); None for an
    output without a batch dim otherwise, since each rank and microbatch then reduces over its
    own rows only (a 0-dim loss, ``plan.scalar_outputs``, is compared as a dp mean instead)."""
    dp = plan.mesh["dp"]
    if want.dim() and want.shape[0] == rows:
        n = rows // dp
        return want[dp_rank * n:(dp_rank + 1) * n]
    return want if dp == 1 and plan.mesh["pp"] == 1 else None


def _dp_mean(value: torch.Tensor, plan: ParallelPlan, ctx: RankContext) -> torch.Tensor:
    """The mean of a 0-dim output over the data-parallel ranks (all hold the last stage
    together, so all reach this collective)."""
    value = value.detach().float().clone()
    if plan.mesh["dp"] > 1:
        dist.all_reduce(value, group=ctx.group("dp"))
        value /= plan.mesh["dp"]
    return value


def _compare_tensors(tally, cat, key, stage, plan, ctx, ref, pick, bound=None):
    tp = plan.mesh["tp"]
    for name, param in stage.named_parameters():
        fqn = plan.aliases.get(name, name)
        t, want = pick(param), ref.get(f"{key}.{fqn}")
        if t is None or want is None:  # no gradient (a weight the loss does not use)
            if (t is None) != (want is None):
                tally.mismatch(cat, f"{name}: {key} {'None' if t is None else 'present'} in "
                                    f"the program, {'None' if want is None else 'present'} in "
                                    f"the reference")
            continue
        full = full_tensor(t, plan.tensors[fqn], ctx, tp)
        tally.add(cat, name, full, want, bound(fqn, want) if bound else None,
                  ref.get(f"noise.{key}.{fqn}"))
        if copied_heads(plan.tensors[fqn].layout):
            # tp ranks holding one kv head must hold the same gradient and weights
            spread = copies_max_diff(t, plan.tensors[fqn], ctx, tp)
            tally.add(cat, f"{name} (kv head copies)", torch.tensor([spread]), torch.zeros(1))


def _worst_over_ranks(tally: _Tally) -> dict:
    """Category -> (rank, tensor) of the largest error over all ranks (a pipeline's outputs
    are only on its last stage: rank 0 had no name to give). Collective."""
    mine = {c: (tally.err[c], tally.worst[c]) for c in CATEGORIES}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for c in CATEGORIES:
        rank = max(range(len(every)), key=lambda r: (bool(every[r][c][1]), every[r][c][0], -r))
        out[c] = (rank, every[rank][c][1])
    return out


def _report(tally: _Tally, plan, vcfg: dict, loss, ref: dict, ctx, skipped=()) -> int:
    opt_name = vcfg["optimizer"]
    ref_loss = ref["loss"]
    errs = torch.tensor([tally.err[c] for c in CATEGORIES], dtype=torch.float64)
    bad = torch.tensor([tally.bad[c] for c in CATEGORIES], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    dist.all_reduce(bad)
    ok = bad.sum().item() == 0
    worst = _worst_over_ranks(tally) if not ok else {}
    if ctx.rank == 0:
        m = plan.mesh
        own = {str(t.dtype).replace("torch.", "") for k, t in ref.items()
               if k.startswith("grad.") and t.is_floating_point()} - {"float32"}
        dtypes = ("fp32" if not own else f"the model's own {', '.join(sorted(own))}") \
            if plan.param_dtype == "fp32" else \
            f"param_dtype {plan.param_dtype}, reduce_dtype {plan.reduce_dtype}"
        method = plan.compression.get("method", "none")
        which = plan.param_dtype + (" as the floor; the model's own rounding is added per "
                                    "tensor" if own and plan.param_dtype == "fp32" else "") + (
            f", {method} gradient compression" if method != "none" else "")
        ep = f" (ep={plan.ep})" if plan.ep > 1 else ""
        print(f"verify: mesh pp={m['pp']} x dp={m['dp']}{ep} x tp={m['tp']}, {dtypes}, "
              f"atol={tally.atol:g} rtol={tally.rtol:g} (tolerances for {which})")
        print("verify: an element differs when |got - ref| > atol * max(1, max|ref| of its "
              "tensor) + rtol * |ref|" + (
                  f" + {NOISE_FACTOR} x the unmodified model's own rounding error of the tensor "
                  f"(its step against the same step in float64)" if tally.noise else ""))
        if tally.noisy:
            shown = [f"{name} ({noise:.3g} of max |value| {magnitude:.3g})"
                     for name, (noise, magnitude) in sorted(tally.noisy.items())[:4]]
            more = len(tally.noisy) - len(shown)
            print(f"verify: little is checked of {len(tally.noisy)} tensor(s) on rank 0 whose "
                  f"value the unmodified model's own rounding error is {ILL_CONDITIONED:.0%} or "
                  f"more of: {', '.join(shown)}{f' and {more} more' if more > 0 else ''} (a "
                  f"gradient of a loss that does not depend on the weights, a norm over a "
                  f"near-constant row, a low-precision dtype)")
        if "fp64.loss" in ref:  # emit/reference.py rounding_noise dropped its estimate
            print(f"verify: the model in float64 computes another loss ("
                  f"{float(ref['fp64.loss']):.6g} against {float(ref_loss):.6g} in fp32: code "
                  f"that depends on the dtype, as a float32 mask meeting float64 values), so "
                  f"its rounding error is not estimated and the tolerances above are all")
        if compression_rule(plan):
            print(f"verify: {compression_rule(plan)}")
        if plan.dropout:
            streams = sorted({d["stream"] for d in plan.dropout})
            print(f"verify: dropout inactive in the reference and the program ({len(plan.dropout)} "
                  f"dropout sites; --train draws them from the {' and '.join(streams)} "
                  f"stream(s))")
        if plan.random:
            print(f"verify: {len(plan.random)} random op(s) outside dropout on fixed stand-ins "
                  f"(their distribution's mean) in the reference and the program; --train draws "
                  f"them from the replicated stream")
        print(f"verify: loss {loss.item():.6f} (reference {ref_loss.item():.6f}) max abs err {errs[0]:.3g}")
        print(f"verify: outputs max abs err {errs[1]:.3g}" + (
            f" (not compared, no batch dim to split over dp/microbatches: {', '.join(skipped)})"
            if skipped else ""))
        print(f"verify: gradients (gathered to full shape) max abs err {errs[2]:.3g}")
        print(f"verify: parameters after one {opt_name} step max abs err {errs[3]:.3g}")
        written = sum(1 for k in ref if k.startswith("buffer."))
        if written:
            print(f"verify: buffers the forward writes ({written}): " + (
                f"max abs err {errs[4]:.3g}" if m["dp"] * plan.microbatches == 1 else
                "not compared (each of the dp x microbatches chunks updates them from its own "
                "rows)"))
        if not ok:
            print("verify: mismatches in " + "; ".join(
                f"{c} ({int(b)} mismatched; worst on rank {worst[c][0]}: {worst[c][1] or '-'})"
                for c, b in zip(CATEGORIES, bad.tolist()) if b))
        if not ok and "loss.chunked" in ref:
            line = chunks_line(ref, m["dp"], plan.microbatches, vcfg, loss, plan.param_dtype)
            print(f"verify: {line}")
        print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1
