"""The comparing half of the numerics self-check (:mod:`.numerics_check`): each tp rank's
outputs, gradient pieces and written buffers against the unmodified model's, at ``ATOL`` /
``RTOL`` (or a coarser dtype's rounding, :func:`tolerance`), plus ``NOISE_FACTOR`` x the
model's own rounding error of the tensor where the reference carries it (its float64 step,
as ``run.py --verify`` allows: a gradient that is rounding only, a bias before a BatchNorm
under gradients of 1e6, has no other scale). A difference is a PlanError naming the first
tensor that differs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint.slicing import local_piece
from ..errors import PlanError
from ..plan.dtypes import differentiable
from ..runtime.verify import NOISE_FACTOR, finite_part

ATOL = RTOL = 1e-4
BUG = "internal error (a bug in parallelizer, please report it): "
FIX = "; compile with mesh.tp=1 meanwhile (mesh.pp=1 where mesh.tp is 1 already)"


@dataclass(frozen=True)
class Tolerance:
    atol: float = ATOL
    rtol: float = RTOL
    coarse: str = ""  # the coarser float dtype that set them


_COARSE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def tolerance(sources: dict) -> Tolerance:
    """ATOL / RTOL, or 4 units in the last place of the coarsest float dtype the program
    casts to (bfloat16 before float16): a model computing in it rounds every product, and the
    program's sums in another order (a row_parallel all-reduce, a rank's share of the heads)
    round elsewhere; a wrong program (a gradient missing its sum, scaled by tp) still differs
    by far more."""
    text = "\n".join(sources.values())
    for name, dtype in _COARSE.items():
        if f"torch.{name}" in text:
            tol = max(ATOL, 4 * torch.finfo(dtype).eps)
            return Tolerance(tol, tol, name)
    return Tolerance()


def error(got: torch.Tensor, want: torch.Tensor, margin: list,
          rtol: float = RTOL, atol: float = ATOL, noise: float = 0.0) -> tuple[float, bool]:
    """(max abs error, whether some element differs beyond the tolerance, ``NOISE_FACTOR``
    x ``noise`` added to it); ``margin[0]`` raised to the largest ratio of an element's
    error to its tolerance."""
    pair = finite_part(got.detach(), want.detach())  # the model's own nan matched by nan
    if pair is None:
        return float("inf"), True
    got, want = pair
    if not got.numel():
        return 0.0, False
    diff = (got - want).abs()  # real, a complex parameter's too (S5's Lambda)
    bound = want.abs().mul_(rtol)
    bound += atol * max(1.0, want.abs().max().item()) + NOISE_FACTOR * noise
    ratio = diff.div(bound).max().item()
    margin[0] = max(margin[0], ratio)
    return diff.max().item(), not ratio <= 1.0  # NaN differs


def _rounded_rtol(want: torch.Tensor) -> float:
    """RTOL, or one unit in the last place of a coarser float dtype when the model's own
    gradient is rounded to it (every element exactly a bfloat16 / float16 value: the weight
    is read through a fake quantisation, ``w.to(torch.bfloat16).to(x.dtype)``, whose
    backward rounds the gradient). The program's fp32 sums in another order may then land
    on the neighbouring value."""
    if want.dtype != torch.float32 or want.numel() < 16:
        return RTOL
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(want.to(dtype).to(want.dtype), want) and want.abs().max() > 0:
            return max(RTOL, 2 * torch.finfo(dtype).eps)
    return RTOL


def mismatch(what: str, detail: str, tol: Tolerance = Tolerance()) -> PlanError:
    computes = f", the model computing in {tol.coarse}" if tol.coarse else ""
    return PlanError(f"{BUG}the numerics self-check (every tp rank of the program against the "
                     f"unmodified model on the example batch, fp32{computes}, atol={tol.atol:g} "
                     f"scaled by the tensor's magnitude, rtol={tol.rtol:g}) differs first at "
                     f"{what}: {detail}{FIX}")


def compare_outputs(ranks: list, want, margin: list,
                     tol: Tolerance = Tolerance()) -> float:
    worst = 0.0
    for i, w in enumerate(want.outputs):
        for r, outs in enumerate(ranks):
            got = outs[i]
            if not isinstance(w, torch.Tensor):
                continue
            label = f"output {i}" + (" (the model's loss)" if w.dim() == 0 and
                                     w.is_floating_point() else "")
            if not isinstance(got, torch.Tensor) or got.shape != w.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise mismatch(label, f"shape {shape} on tp rank {r}, the model's "
                                       f"{tuple(w.shape)}")
            if not differentiable(w.dtype):
                if not torch.equal(got, w):
                    raise mismatch(label, f"other values on tp rank {r} (dtype {w.dtype})")
                continue
            err, bad = error(got, w, margin, tol.rtol, tol.atol, want.noise.get(("output", i), 0.0))
            worst = max(worst, err)
            if bad:
                raise mismatch(label, f"max abs error {err:.3g} on tp rank {r}", tol)
    return worst


def compare_grads(plan, grads: list, want, tp: int, margin: list,
                   tol: Tolerance = Tolerance()) -> float:
    """Each rank's gradient piece against the same piece of the reference gradient (a
    program's None against the model's: zeros); a parameter of the model the program does not
    hold must get none, and one whose gradient the model leaves None (no path from it to the
    outputs) must get none either: a zero gradient is not None to weight decay or momentum."""
    worst = 0.0
    for fqn, w in want.grads.items():
        tplan = plan.tensors.get(plan.aliases.get(fqn, fqn))
        held = [g for g in grads if tplan is not None and tplan.fqn in g]
        if not held:
            if w is not None and w.abs().max().item() > 0:
                raise mismatch(f"the gradient of {fqn}", "the program holds no such parameter")
            continue
        if w is None and any(g[tplan.fqn] is not None for g in held):
            raise mismatch(f"the gradient of {fqn}", "the program computes one where the "
                                                     "model's is None (nothing it computes "
                                                     "reaches the outputs)", tol)
        full = torch.zeros(tplan.shape, dtype=w.dtype if w is not None else torch.float32) \
            if w is None else w
        rtol = max(tol.rtol, _rounded_rtol(full))
        for r, mine in enumerate(grads):
            piece = local_piece(full, tplan, tp, r)
            got = mine[tplan.fqn]
            got = torch.zeros_like(piece) if got is None else got
            err, bad = error(got, piece, margin, rtol, tol.atol, want.noise.get(("grad", fqn), 0.0))
            worst = max(worst, err)
            if bad:
                raise mismatch(f"the gradient of {fqn}", f"max abs error {err:.3g} on tp "
                                                          f"rank {r}'s piece", tol)
    return worst


def compare_buffers(plan, modules: list, want, tp: int, margin: list,
                     tol: Tolerance = Tolerance()) -> None:
    """Each rank's piece of every buffer the model's forward wrote, after the program's
    forward, against the same piece of the model's (an integer count exactly)."""
    for r, mods in enumerate(modules):
        for module in mods:
            for name, got in module.named_buffers():
                fqn = plan.aliases.get(name, name)
                w = want.buffers.get(fqn)
                if w is None:
                    continue
                piece = local_piece(w, plan.tensors[fqn], tp, r)
                if not w.is_floating_point():
                    if not torch.equal(got, piece):
                        raise mismatch(f"the buffer {fqn}", f"{got.tolist()} on tp rank {r}, "
                                                            f"the model's {piece.tolist()}")
                    continue
                err, bad = error(got, piece, margin, tol.rtol, tol.atol,
                                 want.noise.get(("buffer", fqn), 0.0))
                if bad:
                    raise mismatch(f"the buffer {fqn} after the forward",
                                    f"max abs error {err:.3g} on tp rank {r}'s piece", tol)
