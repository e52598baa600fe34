"""Activation bytes per microbatch of each emitted stage, from a forward on FakeTensors.

Every tensor autograd saves for backward passes through a ``saved_tensors_hooks`` pack
hook; its storage's size is counted once (views share a storage) unless the storage is a
parameter's (weights saved by a matmul are model states, counted elsewhere). Forward hooks
on the emitted blocks attribute the bytes to the block that saved them, so activation
checkpointing can be applied afterwards: a checkpointed block keeps only its inputs and
recomputes its saved tensors in backward, one block at a time (Korthikanti et al. 2022,
§4.1; ``torch.utils.checkpoint`` non-reentrant). The tp collectives are identities here (no
process group), and the emitted stages hold tp-local shapes, so the sizes are per tp rank;
sequence-parallel operators give a tp rank's shapes (``runtime.sequence.ShapeComm``).
Under ``mixed_precision`` the saved floating-point bytes are scaled by the ``param_dtype``
size (an approximation: normalisations that upcast save some fp32 tensors). Rows that the
model counts at run time (per-module experts) are valued at balanced routing
(advisor/expert_rows.py).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten

from ..errors import ModelFileError
from ..frontend.model_file import call_loss_fn
from ..plan.dtypes import differentiable
from ..plan.out_spec import loads as out_spec_loads
from ..runtime.fake_kernels import fake_forward_kernels
from .expert_rows import BalancedExpertRows
from ..plan.parallel_plan import ParallelPlan


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _key(t: torch.Tensor):
    return t.untyped_storage()._cdata


class _Recorder:
    def __init__(self, stage: torch.nn.Module, scale: float):
        self.exclude = {_key(p) for p in stage.parameters()} | {_key(b) for b in stage.buffers()}
        self.seen: set = set()
        self.current = None  # the block running now, None outside blocks
        self.saved: dict = {}  # block fqn (None = stage level) -> bytes
        self.scale = scale

    def pack(self, t: torch.Tensor):
        k = _key(t)
        if k not in self.exclude and k not in self.seen:
            self.seen.add(k)
            # a SymInt where the model counts rows at run time: valued after the forward
            n = t.untyped_storage().nbytes()
            self.saved.setdefault(self.current, []).append((n, t.is_floating_point()))
        return t

    def bytes(self, block, value) -> int:
        """Bytes ``block`` saved (None: outside blocks), sizes made ints by ``value``."""
        return sum(int(value(n) * self.scale) if floating else value(n)
                   for n, floating in self.saved.get(block, []))


def _tensor_bytes(args, seen: set) -> int:
    """Bytes of the tensors in ``args`` whose storage is not in ``seen`` (then added)."""
    total = 0
    for a in args:
        if isinstance(a, torch.Tensor) and _key(a) not in seen:
            seen.add(_key(a))
            total += a.untyped_storage().nbytes()
    return total


def _microbatch(plan: ParallelPlan, batch, mode) -> list:
    """The flat inputs (FakeTensors of ``mode``) of one microbatch on one data-parallel rank."""
    from ..runtime.batching import flatten
    flat = flatten(plan, batch)
    m = plan.microbatches if plan.mesh["pp"] > 1 else 1
    rows = max(1, flat[0].shape[0] // (plan.mesh["dp"] * m))
    return [mode.from_tensor(t[:rows], static_shapes=True) for t in flat]


def stage_activations(stages: list, plan: ParallelPlan, batch, loss_fn, mode,
                      per_block: dict | None = None,
                      alltoall: list | None = None) -> list[tuple[int, int]]:
    """Per stage: (bytes kept per microbatch, transient bytes of one block's recompute).
    ``per_block``, if given, gets block FQN -> bytes its forward saved (not checkpointed);
    ``alltoall``, if given, gets per stage the bytes of its largest expert-parallel
    dispatch or combine (runtime/expert_parallel.py ``BalancedShapes``; 0 without ep)."""
    from ..runtime import expert_parallel, sequence, tp
    # the tp operators give the shapes a tp rank has, with no collective on FakeTensors (the
    # compile's own shape check's stand-in): f and g keep them, a scatter to the rank's
    # heads cuts a replicated per-head buffer as on a cluster (RetNet's decay mask, which
    # f and g as identities left whole: "Attempting to broadcast a dimension of length 4");
    # sequence-parallel regions hold 1/tp of the sequence (Korthikanti et al. 2022,
    # Table 2: sbh/t (34 + 5as/h)); dispatch and combine give an ep rank's rows under
    # balanced routing
    with tp.using_transport(tp.ShapeTransport(plan.mesh["tp"])), \
            sequence.using_comm(sequence.ShapeComm(plan.mesh["tp"])), \
            expert_parallel.balanced_shapes(plan.ep) as balanced, fake_forward_kernels(), \
            BalancedExpertRows() as rows:
        return _stage_activations(stages, plan, batch, loss_fn, mode, per_block, balanced,
                                  alltoall, rows.value)


def _stage_activations(stages: list, plan: ParallelPlan, batch, loss_fn, mode,
                       per_block: dict | None, balanced, alltoall: list | None,
                       value) -> list[tuple[int, int]]:
    scale = DTYPE_BYTES[plan.param_dtype] / 4
    inputs = _microbatch(plan, batch, mode)
    target = None
    out = []
    for index, stage in enumerate(stages):
        balanced.sizes = []
        rec = _Recorder(stage, scale)
        block_inputs, input_seen = {}, set()
        hooks = []
        for name, block in stage.emitted_blocks():
            def pre(mod, args, name=name):
                rec.current = name
                block_inputs[name] = _tensor_bytes(args, input_seen)
            hooks.append(block.register_forward_pre_hook(pre))
            hooks.append(block.register_forward_hook(lambda *a: setattr(rec, "current", None)))
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            flat = stage(*inputs)
            flat = tuple(flat) if isinstance(flat, (tuple, list)) else (flat,)
            if index == len(stages) - 1:
                target = _loss_target(plan, batch, mode)
                _loss_activations(loss_fn, list(flat), target, plan, rec)
        for h in hooks:
            h.remove()
        kept, recompute = rec.bytes(None, value), 0
        for name, _ in stage.emitted_blocks():
            saved = rec.bytes(name, value)
            if per_block is not None:
                per_block[name] = saved
            if name in plan.checkpointed:
                kept += int(value(block_inputs.get(name, 0)) * scale)
                recompute = max(recompute, saved)
            else:
                kept += saved
        out.append((kept, recompute))
        if alltoall is not None:
            alltoall.append(int(balanced.peak(value) * scale) if plan.ep > 1 else 0)
        inputs = [t.detach().requires_grad_(differentiable(t.dtype)) for t in flat]
    return out


def _loss_activations(loss_fn, flat: list, target, plan: ParallelPlan, rec: _Recorder) -> None:
    """``loss_fn`` on the last stage's outputs, what it saves recorded. A vocab_parallel
    output is one tp rank's vocabulary columns here, a plain tensor (``run.py`` hands
    loss_fn a DTensor Shard(-1)), and a loss_fn reading the vocabulary size as a constant
    (``logits.reshape(-1, V)``) fails on it (3 of 3 estimates tried in zoo 21). It then runs
    on the outputs widened to the whole vocabulary (the rank's columns repeated), and the
    vocabulary-wide tensors it saves are counted at 1 / tp, the rank's share of a
    vocabulary-parallel loss."""
    spec = out_spec_loads(plan.out_spec)
    saved = rec.saved.setdefault(rec.current, [])
    before = len(saved)
    try:
        call_loss_fn(loss_fn, tree_unflatten(flat, spec), target, None)
        return
    except ModelFileError:
        if not plan.vocab_outputs:
            raise
    del saved[before:]  # what the failed call saved before it failed
    widened = list(flat)
    for i, vocab in plan.vocab_outputs:
        t = flat[i]
        widened[i] = torch.cat([t] * -(-vocab // t.shape[-1]), dim=-1)[..., :vocab]
    call_loss_fn(loss_fn, tree_unflatten(widened, spec), target, None)
    tp, vocabs = plan.mesh["tp"], [v for _i, v in plan.vocab_outputs]
    saved[before:] = [(n // tp if floating and _vocab_wide(n, vocabs) else n, floating)
                      for n, floating in saved[before:]]


def _vocab_wide(nbytes, vocabs: list) -> bool:
    """A saved tensor of a whole number of rows of a vocabulary (log-softmax's output), not a
    per-token one (the targets, the loss's weight). By bytes, so a per-token floating
    tensor whose bytes are a multiple of the vocabulary is counted at 1 / tp too: an error
    of a vocabulary's fraction of the loss's saved bytes, in an estimate."""
    return isinstance(nbytes, int) and any(nbytes % v == 0 for v in vocabs)


def _loss_target(plan: ParallelPlan, batch, mode):
    """The loss target of one microbatch (the batch itself, as ``loss_fn`` expects)."""
    from ..runtime.batching import to_batch
    return to_batch(plan, _microbatch(plan, batch, mode))
