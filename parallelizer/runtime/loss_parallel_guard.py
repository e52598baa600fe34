"""Where torch's ``loss_parallel`` computes a wrong gradient, found on the autograd graph of
the loss before any backward runs.

``loss_parallel`` (``torch.distributed.tensor.parallel.loss``) computes cross-entropy over
logits sharded along the classes by fusing the two halves' backwards: ``nll_loss``'s backward
returns the gradient with respect to the *logits*, ``(softmax(x) - onehot) * g``, and
``log_softmax``'s backward is made the identity (its ``_log_softmax_backward_handler``). That
holds only while every use of a ``log_softmax`` under the context is an ``nll_loss`` and every
``nll_loss`` reads a ``log_softmax``. A ``loss_fn`` with an entropy bonus
(``(p * logits.log_softmax(-1)).sum(-1)``), a distillation KL or log-probabilities computed
another way (``x - x.logsumexp(-1)``) then gets silently wrong gradients of the logits (a
break test: 16 gradients differing by up to 5e-4, the loss itself exact). Pure data movement
between the two (a view, a transpose, a slice, a cast) keeps the element-wise correspondence
the fused formula relies on.
"""
from __future__ import annotations

import torch

_NLL = {"NllLossBackward", "NllLoss2DBackward"}
_LOG_SOFTMAX = "LogSoftmaxBackward"
_MOVES = {"ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "TransposeBackward",
          "PermuteBackward", "SliceBackward", "SelectBackward", "SqueezeBackward",
          "UnsqueezeBackward", "ExpandBackward", "CloneBackward", "ToCopyBackward"}


def _kind(fn) -> str:
    return type(fn).__name__.rstrip("0123456789")


def fused_backward_misuse(loss: torch.Tensor, inputs) -> str | None:
    """None when every ``log_softmax`` between ``inputs`` and ``loss`` reaches the loss only
    through ``nll_loss`` (data movement between them allowed) and every ``nll_loss`` reads a
    ``log_softmax``; else what breaks that, in words. ``inputs``: the tensors handed to
    ``loss_fn``; the walk stops at them (the model's graph behind them is not read)."""
    stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    consumers: dict = {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn in stop:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                consumers.setdefault(nxt, []).append(fn)
                stack.append(nxt)
    for fn in seen:
        if _kind(fn) == _LOG_SOFTMAX:
            other = _other_reader(fn, consumers)
            if other:
                return f"a log_softmax is read by {other}, not only by nll_loss / cross_entropy"
        if _kind(fn) in _NLL and not _reads_log_softmax(fn):
            return "an nll_loss reads log-probabilities that no log_softmax computed"
    return None


def _other_reader(fn, consumers: dict) -> str | None:
    """The first op other than nll_loss reached from ``fn`` through data movement."""
    for c in consumers.get(fn, ()):
        if _kind(c) in _MOVES:
            other = _other_reader(c, consumers)
            if other:
                return other
        elif _kind(c) not in _NLL:
            return _kind(c).removesuffix("Backward").lower()
    return None


def _reads_log_softmax(fn) -> bool:
    node = fn.next_functions[0][0] if fn.next_functions else None
    while node is not None and _kind(node) in _MOVES:
        node = node.next_functions[0][0] if node.next_functions else None
    return node is not None and _kind(node) == _LOG_SOFTMAX
