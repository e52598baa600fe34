"""An autograd.Function whose forward writes in place into views of its own clones
(mambapy's ``PScan``: a scan over slices), captured (frontend/saved_reads.py).

torch.export inlines the forward and runs it under autograd: an op saved a slice for
backward, a later in-place write into the same clone bumped its version, and the captured
graph's backward failed ("modified by an inplace operation"), as did every emitted program,
tp1 included (an internal error of the rank check). The capture's gradient check had not
run either: mambapy binds ``pscan = PScan.apply`` at import, before the check patched
``apply`` to record the Functions applied (frontend/custom_functions.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parallelizer.errors import CaptureError
from parallelizer.frontend.capture import capture


class _Scan(torch.autograd.Function):
    """h[t] = a[t] * h[t-1] + x[t], written into slices of a clone of x, as PScan does."""

    @staticmethod
    def forward(ctx, a_in, x_in):
        a, x = a_in.clone(), x_in.clone()
        for t in range(1, x.shape[1]):
            x[:, t].add_(a[:, t].mul(x[:, t - 1]))
        a[:, 1:].mul_(a[:, :-1])  # a write whose other operand is a slice of the same clone
        ctx.save_for_backward(a_in, x)
        return x + 0 * a

    @staticmethod
    def backward(ctx, grad):
        a, h = ctx.saved_tensors
        g = grad.clone()
        for t in range(g.shape[1] - 1, 0, -1):
            g[:, t - 1].add_(a[:, t] * g[:, t])
        ga = torch.zeros_like(a)
        ga[:, 1:] = h[:, :-1] * g[:, 1:]
        return ga, g


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


scan = _Scan.apply  # bound once, as mambapy's ``pscan = PScan.apply``
straight_through = _StraightThrough.apply


class _ScanModel(nn.Module):
    def __init__(self, fn=scan):
        super().__init__()
        self.fn = fn
        self.gate, self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.inp(x)
        if self.fn is scan:
            h = scan(torch.sigmoid(self.gate(x)), h)
        else:
            h = self.fn(h)
        return self.out(h)


def test_a_scan_writing_into_slices_of_its_clones_differentiates_as_the_model():
    torch.manual_seed(0)
    model, x = _ScanModel(), torch.randn(2, 6, 8)
    gm = capture(model, (x,), Path("model.py")).gm
    cotangent = torch.randn(2, 6, 8)
    want = torch.autograd.grad((model(x) * cotangent).sum(), list(model.parameters()))
    (y,) = gm(x)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    got = torch.autograd.grad((y * cotangent).sum(), list(gm.parameters()))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_function_whose_apply_was_bound_at_import_is_checked():
    """Its backward (a straight-through estimator) is not the forward's derivative: refused,
    as when the model calls ``_StraightThrough.apply`` itself."""
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="_StraightThrough at test_saved_reads.py"):
        capture(_ScanModel(straight_through), (torch.randn(2, 6, 8),), Path("model.py"))
    assert _StraightThrough.forward is _StraightThrough.__dict__["forward"].__func__ \
        and not hasattr(_StraightThrough.forward, "__wrapped__")  # restored after capture


def test_the_scan_compiles_and_its_program_runs_forward_and_backward():
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    torch.manual_seed(0)
    compile_module(_ScanModel(), (torch.randn(2, 6, 8),), Spec.model_validate({"mesh": {"tp": 1}}),
                   reference=False)
