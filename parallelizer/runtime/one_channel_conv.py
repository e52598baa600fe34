"""A convolution the tensor-parallel pass left with one channel on each rank, run without
oneDNN on the CPU.

A depthwise conv over sharded heads or channels keeps ``groups / tp`` groups per rank; at
tp = groups each rank holds one channel, and torch routes a conv of one channel and one
group to its regular path, oneDNN on the CPU. In torch 2.13 that path's backward corrupts
the heap when the kernel is longer than the input (Nystromformer's 65-tap conv over the
values of each head, on a 16-token batch at tp 4: ``corrupted size vs. prev_size``, the
compile's self-check and ``run.py`` killed), where the unmodified model's depthwise conv of
4 channels takes torch's depthwise kernel. Forward and backward here run the same ATen
ops with oneDNN off, so the result is the convolution's; on other devices the op is the
plain ``aten.convolution``.
"""
from __future__ import annotations

import contextlib

import torch

aten = torch.ops.aten


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups):
        n = w.dim() - 2
        ctx.args = (list(b.shape) if b is not None else None, stride, padding, dilation,
                    False, [0] * n, groups)
        ctx.save_for_backward(x, w)
        with _without_onednn(x):
            return aten.convolution(x, w, b, stride, padding, dilation, False, [0] * n, groups)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        bias_sizes, *rest = ctx.args
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias_sizes is not None]
        with _without_onednn(x):
            gx, gw, gb = aten.convolution_backward(grad, x, w, bias_sizes, *rest, mask)
        return gx, gw, gb, None, None, None, None


@contextlib.contextmanager
def _without_onednn(x: torch.Tensor):
    """oneDNN off while the block runs, on the CPU (elsewhere the user's setting holds);
    only ``enabled``: ``mkldnn.flags`` also sets TF32 and warns on every call."""
    if x.device.type != "cpu":
        yield
        return
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


def conv_one_channel(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """``aten.conv{1,2,3}d(x, w, b, stride, padding, dilation, groups)`` (int or list
    arguments, as the captured graph holds them), oneDNN off on the CPU (module docstring).
    Shapes: x (N, C, *S), w (C_out, C / groups, *k), b (C_out,) or None."""
    n = w.dim() - 2
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * n  # noqa: E731
    return _Conv.apply(x, w, b, as_list(stride), as_list(padding), as_list(dilation), groups)
