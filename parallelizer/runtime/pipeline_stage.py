"""torch's ``PipelineStage`` made safe for split backward (zero-bubble schedules) over FSDP2,
for integer inputs received by a later stage, and for complex activations between stages.

Zero-bubble schedules (``interleaved_zero_bubble``, ``zbv``, ``dualpipev``; Qi et al. 2024,
§2) split a stage's backward into an input-gradient action I and a weight-gradient action W.
torch 2.13 (``torch/distributed/pipelining/stage.py``, ``backward_maybe_with_nosync``) hands
``self.submod.parameters()`` to both: I (``_backward.stage_backward_input``) finds the
autograd graph's nodes between those parameters and the stage output, and W
(``stage_backward_weight``) computes the gradients of exactly those parameters. FSDP2
registers on a module whichever parameters are current: the unsharded ones (the leaves the
forward used) while it is unsharded, the sharded DTensors after it resharded. Under ZeRO-3
each block reshards after every forward (``reshard_after_forward=True``), and the schedule's
stage-level UNSHARD does not stop that, so I usually sees the sharded DTensors: none of them
is in the graph and the block's weight gradient of that microbatch is silently dropped
(Llama example, zbv, pp=2 x dp=2: middle-stage gradients 0.085-0.45 of the true ones, the
last stage's block none at all; max abs err 4.1e-2).

Unsharding the stage's FSDP2 modules right before I and W (a no-op when they already are)
makes ``parameters()`` the graph's leaves again; FSDP2 reuses the same unsharded Parameter
objects across reshards, so the nodes I recorded are still those W finds. The extra cost is
one all-gather for a W whose block was resharded by a later forward since its I.

Shape inference. Before the first step, torch runs each stage once on tensors built from
the metadata it received (``_forward_metadata_inference`` -> ``_to_tensor`` ->
``TensorMeta.to_tensor``: ``torch.empty``). An integer input a later stage uses as an index
(per-token ``labels`` of a cross-entropy, a gather index) then holds whatever memory was
there and the inference forward fails (``IndexError: Target 140070266805680 is out of
bounds``). Zero-filled inputs are valid indices for any non-empty dim, and the inference
result does not depend on the values. That forward and its backward run with dropout
inactive: they would otherwise draw from the dropout streams (``runtime/rng.py``) once more
on the first step of each new schedule, so a run resumed at step k drew other masks than
the uninterrupted one. It is a real forward of the stage, so it also wrote the buffers the
model updates in forward (BatchNorm's running statistics and count, a running mean kept by
``rm.mul_(0.9).add_(...)``) once more than the model does before the first step (from the
first microbatch on the first stage, from zeros on the others): the buffers that changed
are put back after it, after its backward where one follows (zoo 22 F2, whose pp2 loss
matched no run of the model).

Complex inputs. ``TensorMeta.to_tensor`` (torch 2.13, pipelining/_utils.py) sets
``requires_grad`` only on a floating-point tensor (``is_floating_point()`` is False for
complex64), so the inference forward of a stage receiving a complex activation that carries
gradient (a model whose hidden state is complex) saw it without one: no gradient metadata
went back, the previous stage allocated no buffer for it, and the first backward stopped
(``PipeliningMetadataError``: "buffer is not None but tensor_meta is None"). The inference
input is given the metadata's ``requires_grad`` whatever its dtype.

Contiguous sends. gloo and NCCL send and receive only contiguous tensors; torch sends the
gradients of a stage's inputs as autograd returns them, which may be strided views (the
compiler makes forward outputs contiguous in the emitted stage, ``passes/split_stages.py``).
The receiver's gradient buffer is ``torch.empty_strided`` of the metadata the sender's
shape-inference backward reported (``_backward_metadata_inference``), so that metadata must
be the contiguous layout too: ConvNeXt's stage input, read through
``permute(0, 2, 3, 1)``, has a channels-last gradient, and the previous rank's ``irecv``
into a channels-last buffer failed ("input tensor has to be contiguous").
"""
from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import TensorMeta

from .rng import dropout_active


def unshard_fsdp_modules(module: torch.nn.Module) -> None:
    """Unshard every FSDP2 module in ``module`` (all-gathers issued together, then waited
    on); no-op for the ones already unsharded and for a module without FSDP2."""
    handles = [m.unshard(async_op=True) for m in module.modules() if isinstance(m, FSDPModule)]
    for handle in handles:
        handle.wait()


def buffer_values(module: torch.nn.Module) -> list:
    """(buffer, a copy of its value) for every buffer of ``module``."""
    return [(b, b.detach().clone()) for b in module.buffers()]


def put_back(saved: list) -> None:
    """Every buffer of ``saved`` (:func:`buffer_values`) that now holds another value gets
    its saved one back; the others are not written (their version unchanged)."""
    with torch.no_grad():
        for b, value in saved:
            if not torch.equal(b, value):
                b.copy_(value)


class SplitBackwardPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose input- and weight-gradient actions see the unsharded FSDP2
    parameters, and whose shape-inference inputs are zeros, not uninitialised memory (see
    the module docstring); full backwards are unchanged (FSDP2's own pre-backward hooks
    unshard there)."""

    def _to_tensor(self, arg):
        t = super()._to_tensor(arg)
        if isinstance(arg, TensorMeta):  # see "Shape inference" in the module docstring
            with torch.no_grad():
                t.zero_()
            if t.is_complex() and arg.requires_grad:  # see "Complex inputs"
                t.requires_grad_(True)
        return t

    def _forward_metadata_inference(self, *args, **kwargs):
        # shapes only: no draws, no buffer writes (see the module docstring); the buffers
        # are put back after the backward inference where one follows, since its autograd
        # graph may hold them (a rotary table) and a write between would invalidate it
        has_backward = kwargs.get("has_backward", args[2] if len(args) > 2 else False)
        self._buffers_before = buffer_values(self.submod)
        try:
            with dropout_active(False):
                return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            if not has_backward:
                put_back(self._buffers_before)

    def _backward_metadata_inference(self, *args, **kwargs):
        # its backward may recompute checkpointed blocks of that forward: same mode
        try:
            with dropout_active(False):
                return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            put_back(getattr(self, "_buffers_before", []))

    def _compute_input_grads(self, *args, **kwargs):
        # shape inference only: the gradient metadata sent back is what get_bwd_send_ops
        # sends, contiguous (see "Contiguous sends" in the module docstring)
        grads = super()._compute_input_grads(*args, **kwargs)
        return tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        if not full_backward:
            unshard_fsdp_modules(self.submod)
        return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                          last_backward=last_backward)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        grads = self.bwd_cache.get(bwd_chunk_id)
        if grads is not None:  # see "Contiguous sends" in the module docstring
            self.bwd_cache[bwd_chunk_id] = tuple(
                g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return super().get_bwd_send_ops(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
        unshard_fsdp_modules(self.submod)
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


class TimedPipelineStage(SplitBackwardPipelineStage):
    """A ``PipelineStage`` (:class:`SplitBackwardPipelineStage`) that records ``(start, end)`` of each compute call into
    ``self.intervals`` while that list is not None (None: no timing, no synchronisation)."""

    intervals: list | None = None

    def _timed(self, fn, *args, **kwargs):
        if self.intervals is None:
            return fn(*args, **kwargs)
        sync_device(self.device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync_device(self.device)
            self.intervals.append((start, time.perf_counter()))

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
