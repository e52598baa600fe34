"""Reference results of the unmodified model on its example inputs, for ``run.py --verify``:
inputs, flat outputs, loss, gradients and parameters after one optimizer step, all fp32 on
CPU, keyed ``input.NAME``, ``output.I``, ``loss``, ``grad.FQN``, ``param.FQN``. Dropout is
inactive (the model stays in training mode) and every other random op gives its fixed
stand-in (``runtime.rng.RandomStandIns``: a drop path's ``torch.rand`` is 0.5), as in the
program under ``--verify``."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..frontend.capture import split_args
from ..frontend.model_file import call_loss_fn
from ..runtime.optim import make_optimizer
from ..runtime.rng import EagerDropoutOff, RandomStandIns


def compute_reference(model: torch.nn.Module, batch, loss_fn, input_names, spec,
                      model_file=None) -> dict:
    """Run one training step of ``model`` (mutates it: call after snapshotting weights)
    with ``spec.verify.optimizer`` at ``spec.optimizer.lr``."""
    args, kwargs = split_args(batch)
    flat_in, _ = tree_flatten((args, kwargs))
    ref = {f"input.{n}": t.detach().clone().contiguous() for n, t in zip(input_names, flat_in)}
    model.zero_grad(set_to_none=True)
    with EagerDropoutOff(), RandomStandIns():
        outputs = model(*args, **kwargs)
    loss = call_loss_fn(loss_fn, outputs, batch, model_file,
                        " (the reference step: the unmodified model's outputs on example_inputs())")
    loss.backward()
    flat_out, _ = tree_flatten(outputs)
    ref["loss"] = loss.detach().reshape(())
    for i, t in enumerate(flat_out):
        ref[f"output.{i}"] = t.detach().contiguous()
    named = dict(model.named_parameters())  # canonical names (first alias) only
    for name, p in named.items():
        if p.grad is not None:
            ref[f"grad.{name}"] = p.grad.detach().clone()
    opt = make_optimizer(named.values(), spec.verify.optimizer, spec.optimizer.lr,
                         spec.optimizer.weight_decay)
    opt.step()
    for name, p in named.items():
        ref[f"param.{name}"] = p.detach().clone()
    return ref


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
