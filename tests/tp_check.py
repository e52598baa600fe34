"""One-call tensor-parallel check for the tests of models outside the zoo: capture, plan at
``tp``, rewrite, and run the ranks in lockstep (tp_lockstep.py): outputs, every gradient
and the parameters after one SGD step equal the unmodified model's pieces (fp32, 1e-5)."""
from __future__ import annotations

import copy

import torch

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from tp_lockstep import RankStreams, local, run_ranks
from tp_small_models import captured

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1


def weighted_loss(outs):
    """A loss reading every floating-point output element with its own fixed weight."""
    g = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs
               if isinstance(o, torch.Tensor) and o.is_floating_point())


def assert_tp_matches(model, batch, tp, decision, gm, seed=None):
    """Each simulated rank's outputs, gradients and SGD-stepped parameters of the rewritten
    ``gm`` equal the unmodified ``model``'s (its pieces for sharded tensors). ``seed``: the
    model draws after ``torch.manual_seed(seed)`` and each rank from its own streams seeded
    as ``init`` seeds them (tp_lockstep.RankStreams); returns the model's outputs."""
    ref = copy.deepcopy(model)
    if seed is not None:
        torch.manual_seed(seed)
    outs = ref(*batch)
    outs = outs if isinstance(outs, tuple) else (outs,)
    weighted_loss(outs).backward()
    params = dict(ref.named_parameters(remove_duplicate=False))  # a shared module's every name
    streams = None if seed is None else RankStreams(seed, tp)
    for r, res in enumerate(run_ranks(gm, decision, tp, list(batch), weighted_loss, LR, streams)):
        for got, want in zip(res.outputs, outs):
            torch.testing.assert_close(got, want, **TOL)
        for fqn, grad in res.grads.items():
            want = params[fqn].grad
            torch.testing.assert_close(grad, local(want, fqn, decision, tp, r), **TOL,
                                       msg=lambda m: f"rank {r} {fqn}: {m}")
            stepped = params[fqn].detach() - LR * want
            torch.testing.assert_close(res.params[fqn], local(stepped, fqn, decision, tp, r),
                                       **TOL, msg=lambda m: f"rank {r} {fqn}: {m}")
    return outs


def planned(model, batch, tp):
    """``model`` captured on ``batch``, planned at ``tp`` and rewritten: (gm, TPDecision)."""
    gm = captured(model, batch).gm
    decision = plan_tp(gm.graph, tp)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, decision)
    return gm, decision


def plan_and_check(model, batch, tp):
    """The TPDecision of ``model`` at ``tp``, after :func:`assert_tp_matches` on ``batch``."""
    gm, decision = planned(model, batch, tp)
    assert_tp_matches(model, batch, tp, decision, gm)
    return decision
