"""Reference results of the unmodified model on its example inputs, for ``run.py --verify``:
inputs, flat outputs, loss, gradients and parameters after one optimizer step, all fp32 on
CPU, keyed ``input.NAME``, ``output.I``, ``loss``, ``grad.FQN``, ``param.FQN``, and
``buffer.FQN`` for each buffer the forward writes (BatchNorm's running statistics). Dropout is
inactive (the model stays in training mode) and every other random op gives its fixed
stand-in (``runtime.rng.RandomStandIns``: a drop path's ``torch.rand`` is 0.5), as in the
program under ``--verify``."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..analysis.batch_mixing import batch_mixing
from ..errors import CaptureError, ModelFileError, PlanError
from ..frontend.capture import eager_message, split_args
from ..frontend.custom_functions import checkpoint_off
from ..frontend.model_file import call_loss_fn, headline
from ..runtime.optim import make_optimizer
from ..runtime.rng import EagerDropoutOff, RandomStandIns
from ..runtime.verify import fp64_agrees, not_sample_mean, unheld_gradients, within


def compute_reference(model: torch.nn.Module, batch, loss_fn, input_names, spec,
                      model_file=None, chunks: bool = True, count=None) -> dict:
    """Run one training step of ``model`` (mutates it: call after snapshotting weights)
    with ``spec.verify.optimizer`` at ``spec.optimizer.lr``; with ``noise.KEY`` entries
    (:func:`rounding_noise`) for models of at most NOISE_MAX_PARAMETERS parameters.
    ``chunks``: also the loss over the program's dp x microbatch chunks (``loss.chunked``).
    ``count``: where the program's loss is one token mean over the whole step's count
    (runtime/token_mean.py), the plan's counter (its inputs the flat batch, its first value
    the count): each chunk's loss is then weighted by its share of the count, as the program
    weighs it, so that only what else couples the chunks (BatchNorm's statistics) shows."""
    args, kwargs = split_args(batch)
    flat_in, _ = tree_flatten((args, kwargs))
    ref = {f"input.{n}": t.detach().clone().contiguous() for n, t in zip(input_names, flat_in)}
    wide = fp64_copy(model)
    chunk_grads: dict = {}
    ref.update(_one_step(model, batch, loss_fn, spec, model_file, chunks, chunk_grads, count))
    if wide is not None:
        ref.update(rounding_noise(ref, wide, batch, loss_fn, spec, model_file))
    ref.update(gradient_gap(ref, chunk_grads, spec.verify.atol, spec.verify.rtol))
    return ref


# the fp64 copy of rounding_noise costs twice the fp32 model in memory: 0.5 GiB here
NOISE_MAX_PARAMETERS = 1 << 26


def fp64_copy(model: torch.nn.Module):
    """``model`` in float64 (before its step), or None when it is too large or holds a
    parameter on another device than the CPU or of a non-floating dtype."""
    params = list(model.parameters())
    if sum(p.numel() for p in params) > NOISE_MAX_PARAMETERS or any(
            p.device.type != "cpu" or not p.is_floating_point() for p in params):
        return None
    return copy_model(model).double()


def carried_tensors(model: torch.nn.Module) -> list[str]:
    """FQNs of the tensors a forward left on ``model``'s modules as plain attributes (not
    parameters or buffers) that are part of an autograd graph."""
    out = []
    for name, m in model.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                out.append(f"{name}.{attr}" if name else attr)
    return out


def _refuse_carried_state(model: torch.nn.Module, e: RuntimeError, model_file) -> None:
    """A backward through an earlier call's freed graph: the model reads, in one call, what
    an earlier call left on its modules (a break test crashed here with torch's traceback)."""
    carried = carried_tensors(model)
    if "backward through the graph a second time" not in str(e) or not carried:
        return
    raise CaptureError(
        f"the model from {model_file or 'memory'} carries tensors from one forward to the next: "
        f"{', '.join(carried[:4])}{' and more' if len(carried) > 4 else ''} hold values of an "
        f"earlier call, with its autograd graph, and the next call reads them (its backward "
        f"then runs through the earlier call's freed graph). The compiled program computes "
        f"each step as the captured call did. Fix: keep such state out of the training "
        f"forward (a cache only when use_cache is set), or detach and reset it every call") from e


def unchanged(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` for a buffer of any layout: a sparse one (openai-whisper's
    ``alignment_heads.to_sparse()``, which forward never reads) compared dense, as sparse
    tensors have no ``aten::equal`` and the compile blamed the model for it (zoo 13 Z4)."""
    if (a.layout, a.dtype, a.shape) != (b.layout, b.dtype, b.shape):
        return False
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    return torch.equal(a, b)


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)``, a tensor a forward left on a module as a plain attribute
    (RecurrentGemma's ``recurrent_states``, computed with gradient) copied detached: deepcopy
    refuses a tensor that is no graph leaf ("Only Tensors created explicitly by the user"),
    and the compile crashed on it (a break test). An attribute deepcopy cannot copy (a
    ``staticmethod`` object held by a module, simple-hierarchical-transformer's
    ``self.apply_rotary_emb``: "cannot pickle 'staticmethod' object", zoo 13 Z11) is shared
    with the copy, as it is no tensor the copy computes with."""
    memo: dict = {}
    tried: set = set()  # one config object is held by every module of a transformers model
    for m in model.modules():
        _detached_into(vars(m), memo, 0)
        for value in vars(m).values():
            if id(value) not in tried:
                tried.add(id(value))
                _shared_if_uncopyable(value, memo)
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - the model's own __deepcopy__: the user's to fix
        raise ModelFileError(
            f"the model build_model() returns cannot be copied with copy.deepcopy "
            f"({type(e).__name__}: {headline(e, '')}); the compile runs copies of it for its "
            f"checks (the numerics self-check, the reference step) and leaves yours as it is. "
            f"Make it copyable (a class whose __deepcopy__ serialises the model must be able "
            f"to rebuild it: keras 3 needs its classes registered with "
            f"keras.saving.register_keras_serializable())") from e


def _shared_if_uncopyable(value, memo: dict) -> None:
    if isinstance(value, (torch.Tensor, torch.nn.Module, dict, list, tuple)):
        return  # the modules' own state: copied (their containers hold modules and tensors)
    try:
        copy.deepcopy(value, dict(memo))
    except Exception:  # noqa: BLE001 - whatever deepcopy refuses is kept as it is
        memo[id(value)] = value


def _detached_into(value, memo: dict, depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if not value.is_leaf:
            memo[id(value)] = value.detach().clone()
    elif isinstance(value, (list, tuple)) and depth < 4:
        for v in value:
            _detached_into(v, memo, depth + 1)
    elif isinstance(value, dict) and depth < 4:
        for v in value.values():
            _detached_into(v, memo, depth + 1)


def rounding_noise(ref: dict, wide: torch.nn.Module, batch, loss_fn, spec, model_file) -> dict:
    """``noise.KEY`` -> max |ref[KEY] - the same step in float64| for the loss, each output,
    gradient and stepped parameter: the unmodified model's own rounding error in its dtype.
    ``--verify`` allows a multiple of it on top of atol/rtol (runtime/verify.py
    NOISE_FACTOR), since a program computing exactly what the model computes, in another
    order, errs about as much: a LayerNorm over a near-constant row (ViT-MAE's class token,
    rstd ~ 1e6) amplifies fp32 rounding of its gradient beyond any fixed atol, and a bf16
    model rounds at 8 bits. {} when the float64 step fails (an op without a float64
    kernel); ``{"fp64.loss": its loss}`` alone when an fp32 model's float64 step computes
    another loss than rounding explains (``verify.fp64_agrees``: dtype-dependent code)."""
    try:
        # the model's warnings showed in its own step; here a float64 weight meeting the fp32
        # a model casts to (torchtune's RMSNorm: x.float()) only warns about this estimate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact = _one_step(wide, to_fp64(batch), loss_fn, spec, model_file, chunks=False)
    except Exception:  # noqa: BLE001  the estimate is optional; the fp32 step ran
        return {}
    loss, wide_loss = ref.get("loss"), exact.get("loss")
    if loss is not None and wide_loss is not None and loss.dtype == torch.float32 \
            and loss.numel() == 1 and not fp64_agrees(float(loss), float(wide_loss)):
        return {"fp64.loss": wide_loss.detach().double().reshape(())}
    out = {}
    for key, want in exact.items():
        got = ref.get(key)
        if got is not None and got.shape == want.shape and got.is_floating_point():
            out[f"noise.{key}"] = torch.tensor(max_abs_diff(got, want), dtype=torch.float32)
    return out


def to_fp64(batch):
    """``batch`` with its floating-point tensors in float64."""
    return tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, batch)


def max_abs_diff(got: torch.Tensor, exact: torch.Tensor) -> float:
    """max |got - exact| over the elements where it is finite (0.0 for none)."""
    diff = (got.double() - exact.double()).abs()
    diff = diff[torch.isfinite(diff)]
    return diff.max().item() if diff.numel() else 0.0


def _one_step(model: torch.nn.Module, batch, loss_fn, spec, model_file, chunks: bool = True,
              chunk_grads: dict | None = None, count=None) -> dict:
    """loss, outputs, gradients, the buffers the forward wrote and the stepped parameters of
    one step of ``model``; with ``chunks``, the loss over the program's dp x microbatch
    chunks too (:func:`chunked_step`), its gradients into ``chunk_grads``."""
    args, kwargs = split_args(batch)
    ref = {}
    model.zero_grad(set_to_none=True)
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    with checkpoint_off():
        with EagerDropoutOff(), RandomStandIns():
            try:
                outputs = model(*args, **kwargs)
            except Exception as e:  # the model as it is: the user's to fix
                raise CaptureError(eager_message(e, model_file or Path("<in-memory model>"))) from e
        loss = call_loss_fn(loss_fn, outputs, batch, model_file,
                            " (the reference step: the unmodified model's outputs on "
                            "example_inputs())")
        try:
            loss.backward()
        except RuntimeError as e:  # the model's own backward (a ReLU output written in
            # place): the self-check, which names it so, does not run for a bf16 model
            _refuse_carried_state(model, e, model_file)
            raise CaptureError(eager_message(e, model_file or Path("<in-memory model>"))) from e
    flat_out, _ = tree_flatten(outputs)
    ref["loss"] = loss.detach().reshape(())
    for i, t in enumerate(flat_out):
        if isinstance(t, torch.Tensor):  # a None leaf (a NamedTuple's unused field) holds none
            ref[f"output.{i}"] = t.detach().contiguous()
    for name, b in model.named_buffers():  # one the forward registers is a cache, no state
        if name in before and not unchanged(b, before[name]):
            ref[f"buffer.{name}"] = b.detach().clone()
    named = dict(model.named_parameters())  # canonical names (first alias) only
    for name, p in named.items():
        if p.grad is not None:
            ref[f"grad.{name}"] = p.grad.detach().clone()
    # the weights before the step; after the whole batch's loss_fn (its errors name the
    # reference step) and its backward (the chunks put buffers back in place)
    step = chunked_step(model, batch, loss_fn, spec.mesh.dp * spec.pipeline.microbatches,
                        model_file, count, start=before) if chunks else None
    if step is not None:
        ref["loss.chunked"] = step[0]
        if chunk_grads is not None:
            chunk_grads.update(step[1])
    opt = make_optimizer(named.values(), spec.verify.optimizer, spec.optimizer.lr,
                         spec.optimizer.weight_decay)
    opt.step()
    for name, p in named.items():
        ref[f"param.{name}"] = p.detach().clone()
    return ref


def batch_rows(batch, size: int, lo: int, hi: int):
    """Samples ``[lo, hi)`` of ``batch``: rows of every tensor whose dim 0 is the batch's
    ``size``; any other value as it is."""
    return tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim()
                    and t.shape[0] == size else t, batch)


def chunked_step(model: torch.nn.Module, batch, loss_fn, chunks: int, model_file=None,
                 count=None, start: dict | None = None):
    """The mean of the model's loss over ``chunks`` equal row chunks of ``batch`` (in order:
    the data-parallel ranks' rows, each cut into its microbatches), as the program computes
    its loss (0-dim fp32), and the gradients of that mean (parameter name -> tensor), or None
    when ``chunks`` is 1 or does not divide the rows. The parameters' ``.grad``, the buffers
    a forward updates (BatchNorm's running statistics) and the random number generator's
    state are put back, so the rest of the reference step is unchanged.

    A loss that is a mean over samples gives the whole batch's loss and gradients back (to
    rounding); one that is not (a router auxiliary loss over the batch's routing, batch
    statistics) does not, and no data-parallel program can then equal the whole-batch
    reference (see runtime/verify.py). A term weighted small (an auxiliary loss x 1e-3) may
    leave the loss within tolerance and still dominate a weight's gradient: both are kept.
    ``count``: a token mean's counter (:func:`compute_reference`); chunk ``c``'s loss is
    weighted ``count(c) / count(batch)`` instead of ``1 / chunks``, and None is returned
    where a chunk counts no token (its mean is 0 / 0) or where the loss's several token
    means weigh the chunks differently (no one weight per chunk is the program's then).
    ``start``: buffer name -> the value the chunks start from (the buffers before the
    whole batch's forward wrote them: a running mean updated in forward, zoo 22 F2, was
    compared from the state the whole batch left)."""
    flat, _ = tree_flatten(batch)
    rows = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim()), 0)
    if chunks <= 1 or not rows or rows % chunks:
        return None
    n = rows // chunks
    parts = [batch_rows(batch, rows, c * n, (c + 1) * n) for c in range(chunks)]
    weights = [1.0 / chunks] * chunks
    if count is not None:
        weights = _count_weights([count(*tree_flatten(split_args(p))[0]) for p in parts])
        if weights is None:
            return None
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    named = dict(model.named_parameters())
    kept = {name: p.grad for name, p in named.items()}
    losses, backward = [], True
    try:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in (start or {}):
                    b.copy_(start[k])
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]), checkpoint_off(), EagerDropoutOff(), \
                RandomStandIns():
            for part, weight in zip(parts, weights):
                a, kw = split_args(part)
                loss = call_loss_fn(loss_fn, model(*a, **kw), part, model_file) * weight
                if backward and loss.requires_grad:
                    try:
                        loss.backward()
                    except RuntimeError:  # state a forward carries over (the step refuses it)
                        backward = False
                losses.append(loss.detach().float())
        grads = {name: p.grad.detach().clone() for name, p in named.items()
                 if p.grad is not None} if backward else {}
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        for name, p in named.items():
            p.grad = kept[name]
    return torch.stack(losses).sum().reshape(()), grads


def _count_weights(counted: list) -> Optional[list]:
    """Each chunk's share of the whole batch's count, from each chunk's per-site counts
    (a token mean's counter), when every site gives the same shares (a contrastive loss's two
    cross-entropies over the same labels; one site); else None, as where a chunk counts
    none of a site's tokens."""
    per_site = torch.tensor([[float(c) for c in chunk] for chunk in counted], dtype=torch.float64)
    if not bool((per_site > 0).all()):
        return None
    shares = per_site / per_site.sum(0)
    if not torch.allclose(shares, shares[:, :1].expand_as(shares), rtol=1e-12, atol=0.0):
        return None
    return shares[:, 0].tolist()


def gradient_gap(ref: dict, grads: dict, atol: float, rtol: float) -> dict:
    """``{"chunked.grad.NAME": max abs difference}`` for the parameter whose gradient over the
    chunks (:func:`chunked_step`) differs most from the whole batch's ``grad.NAME`` beyond
    ``atol`` / ``rtol`` and the model's own rounding error of it (``noise.grad.NAME``, as
    :func:`parallelizer.runtime.verify.within` allows it); {} when none does."""
    worst = None
    for name, g in grads.items():
        want = ref.get(f"grad.{name}")
        noise = float(ref.get(f"noise.grad.{name}", 0.0))
        if want is None or g.shape != want.shape or within(g, want, atol, rtol, noise):
            continue
        err = (g.float() - want.float()).abs().nan_to_num(float("inf")).max().item()
        if worst is None or err > worst[1]:
            worst = (name, err)
    return {} if worst is None else {f"chunked.grad.{worst[0]}": torch.tensor(worst[1])}


def sample_mean_warnings(ref: dict, spec, model=None, graph=None) -> list[str]:
    """The compile's warning when the reference's loss is not a mean over samples at
    ``verify.atol`` / ``verify.rtol`` (:func:`parallelizer.runtime.verify.not_sample_mean`),
    naming the ops of the captured ``graph`` that mix the batch's samples
    (:func:`parallelizer.analysis.batch_mixing.batch_mixing`: a mean over dim 0 was left to
    the warning's list of likely causes, zoo 22 F6) and the model's embeddings that scale
    their gradient by the batch's token counts."""
    why = not_sample_mean(ref, spec.mesh.dp, spec.pipeline.microbatches, spec.verify.atol,
                          spec.verify.rtol)
    if not why:
        return []
    mixing = batch_mixing(graph) if graph is not None else []
    if mixing:
        more = f" and {len(mixing) - 3} more" if len(mixing) > 3 else ""
        why += (f". The model's forward mixes the samples of a batch at {', '.join(mixing[:3])}"
                f"{more}: each chunk computes that over its own rows")
    scaled = [n for n, m in (model.named_modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.scale_grad_by_freq]
    if scaled:
        why += (f". {', '.join(scaled)} {'has' if len(scaled) == 1 else 'have'} "
                f"scale_grad_by_freq=True: each row's gradient is divided by its token's count "
                f"in the chunk, not in the whole batch")
    return [why]


def stack_reference(ref: dict, stacked: dict) -> dict:
    """``ref`` with each group of per-module expert tensors (``grad.<fqn>``, ``param.<fqn>``)
    stacked along a new dim 0 under the stacked name the program holds
    (passes/stack_experts.py); an expert without a gradient (no rows) counts zeros."""
    if not stacked:
        return ref
    out = dict(ref)
    for fqn, members in stacked.items():
        for kind in ("grad", "param"):
            parts = [out.pop(f"{kind}.{m}", None) for m in members]
            if all(p is None for p in parts):
                continue
            like = next(p for p in parts if p is not None)
            out[f"{kind}.{fqn}"] = torch.stack([torch.zeros_like(like) if p is None else p for p in parts])
    return out


def check_gradients_held(ref: dict, plan) -> None:
    """Every parameter the model computes a gradient for on the example batch is one the
    program's ``plan`` holds (:func:`~parallelizer.runtime.verify.unheld_gradients`): one it
    does not hold would never train, so the program is not the model's.

    Raises:
        PlanError: names the parameter (an internal error: the captured graph does not read
            a parameter the model's forward reads).
    """
    missing = unheld_gradients(ref, plan)
    if missing:
        raise PlanError(f"internal error (a bug in parallelizer, please report it): the model "
                        f"computes a gradient for {', '.join(missing[:3])}"
                        f"{' and more' if len(missing) > 3 else ''} on the example batch, but "
                        f"the captured graph does not read it, so the program would never "
                        f"train it")


def nonfinite_warnings(ref: dict) -> list[str]:
    """The compile's warning when the unmodified model's own loss or gradients on the example
    batch hold nan or inf: the program computes the same (the self-check and ``--verify``
    match nan with nan), but one optimizer step spreads them into the parameters."""
    bad = [(k, t) for k, t in ref.items() if k == "loss" or k.startswith("grad.")]
    bad = [(k, t) for k, t in bad if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return []
    key, t = bad[0]
    what = "loss" if key == "loss" else f"gradient of {key[len('grad.'):]}"
    kinds = " and ".join(n for n, m in (("nan", t.isnan()), ("inf", t.isinf())) if bool(m.any()))
    count = int((~torch.isfinite(t)).sum())
    more = [k[len("grad."):] if k.startswith("grad.") else k for k, _ in bad[1:]]
    also = f"; also {', '.join(more[:4])}{', ...' if len(more) > 4 else ''}" if more else ""
    return [f"the unmodified model's own {what} is not finite on the example batch ({count} of "
            f"{t.numel()} elements {kinds}){also}. The program computes the same, but one "
            f"optimizer step makes those parameters nan; fix the model (a common cause: a "
            f"parameter multiplied into a -inf mask, whose backward takes 0 x inf: mask after "
            f"scaling, or with the dtype's finite minimum)"]
