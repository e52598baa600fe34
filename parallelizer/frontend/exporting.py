"""The torch.export calls of the capture (:mod:`.capture`): which dims are dynamic, the
keywords a model's forward takes, and the state each attempt leaves as it was."""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
import warnings
from typing import Any

import torch
from torch.export import Dim
from torch.utils._pytree import tree_map

from . import custom_functions
from .module_state import buffer_values_kept, caches_cleared, state_kept, unchanging_to_kept


def _dynamic_shapes(args: tuple, kwargs: dict, shared_batch: bool = True,
                    sequence: bool = True) -> Any:
    """Dims 0 and 1 of every input tensor dynamic (dim 0 only without ``sequence``), and
    any other dim of the first input's sequence length (dim 1 of the first input of 2+
    dims): torchtune's ``mask=`` (B, S, S), a (B, 1, S, S) attention mask. ``Dim.AUTO``: a
    dim the code needs as a number (a feature dim of that size) is kept static, quietly.
    ``shared_batch``: dim 0 of the inputs
    with the first input's batch size is one symbol, as the runtime treats it (pipeline
    microbatches and dp shards cut every input along dim 0): an encoder-decoder's source
    and target batches are then known equal, so ``nn.MultiheadAttention``'s
    ``k.view(S, bsz * num_heads, head_dim)`` of the memory keeps head_dim a number."""
    flat = list(kwargs.values()) if kwargs else list(args)
    sizes = [v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim()]
    batch = Dim("batch") if shared_batch and len(sizes) > 1 and sizes.count(sizes[0]) > 1 \
        and sizes[0] > 1 else None
    seq = next((v.shape[1] for v in flat if isinstance(v, torch.Tensor) and v.dim() > 1), 1)

    def dims(t: torch.Tensor) -> dict:
        out = {i: Dim.AUTO for i in range(min(t.dim(), 2 if sequence else 1))}
        if sequence and seq > 1:  # an explicit (B, S, S) mask: export keeps S where it is S
            out.update({i: Dim.AUTO for i in range(2, t.dim()) if t.shape[i] == seq})
        if batch is not None and t.dim() and t.shape[0] == sizes[0]:
            out[0] = batch
        return out
    if kwargs:
        return {k: dims(v) for k, v in kwargs.items()}
    return tuple(dims(a) for a in args)


def export_program(model, args, kwargs, static: bool = False, exporter=torch.export.export):
    """torch.export with :func:`_dynamic_shapes`; again with a symbol per input's batch when
    the model's code does not hold one batch dim for them all (it specialises it, or
    an input's dim 0 is not the batch). ``static``: with the sequence static, then with
    every dim static instead, for code that needs a size as a Python number where export
    gives a symbol (openai-whisper's ``is_causal = n_ctx > 1`` for SDPA's bool; diffusers'
    ``torch.randn(shape, generator=None)``, an overload without symbolic sizes).
    ``exporter``: torch.export.export, or draft_export (:mod:`.branches`)."""
    attempts = ((_dynamic_shapes(args, kwargs, shared_batch=False, sequence=False), None)
                if static else (_dynamic_shapes(args, kwargs),
                                _dynamic_shapes(args, kwargs, shared_batch=False)))
    with _named_inputs(model, args, kwargs), warnings.catch_warnings():
        # nn.LSTM / GRU / RNN re-assign their own parameters to _flat_weights in forward:
        # export's warning ("must be registered as buffers") would tell the user to edit
        # torch's module, and what it names are parameters export has already
        warnings.filterwarnings("ignore", message=r"The tensor attributes [^ ]*_flat_weights")
        for i, dyn in enumerate(attempts):
            try:
                with _quiet_shape_log():  # new tensors: a failed export leaves its dims marked
                    inputs = tree_map(_fresh, (args, kwargs)) if static else (args, kwargs)
                    return exporter(model, *inputs, dynamic_shapes=dyn, strict=False)
            except Exception:
                if i == len(attempts) - 1:
                    raise


def _fresh(x):
    """A tensor's copy with none of the marks a failed export left on it (the dims it made
    dynamic, which the next export, asked for static ones, kept symbolic)."""
    return x.clone() if isinstance(x, torch.Tensor) else x


@contextlib.contextmanager
def _quiet_shape_log():
    """A failed export says nothing but its error: a data-dependent branch logged "Unable to
    find user code corresponding to {u0}" (symbolic_shapes' logger) and torch printed the
    partial graph to stderr, about 100 lines before the error that names the model's line
    (the refusal is that error). What an export that succeeds writes to stderr is written
    after it. FakeTensor's logger wrote each failed meta kernel's traceback (six of them, 114
    lines, before a shape error's refusal: zoo 16 Z8); its handler holds the stderr it was
    made with, so only its level keeps it quiet."""
    held = io.StringIO()
    with quiet_logs(_NOISY_LOGS), contextlib.redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())  # only reached when the export did not raise


@contextlib.contextmanager
def quiet_logs(levels: dict):
    """Each logger named in ``levels`` (name -> level) held at its level inside the block,
    set back after it."""
    logs = {logging.getLogger(name): quiet for name, quiet in levels.items()}
    before = {log: log.level for log in logs}
    for log, quiet in logs.items():
        log.setLevel(quiet)
    try:
        yield
    finally:
        for log, level in before.items():
            log.setLevel(level)


# FakeTensor's logger writes a failed meta kernel's traceback, ~40 lines, before the error
# that names the op and the model's line (zoo 16 Z8, zoo 23 F1): the capture and the rank
# check (emit/rank_check.py) hold it at this level
FAKE_TENSOR_LOG = {"torch._subclasses.fake_tensor": logging.CRITICAL}
# loggers a failed export writes its partial work to, and the level
# :func:`_quiet_shape_log` holds each at
_NOISY_LOGS = {"torch.fx.experimental.symbolic_shapes": logging.ERROR, **FAKE_TENSOR_LOG}


@contextlib.contextmanager
def _named_inputs(model, args: tuple, kwargs: dict):
    """Each input that ``forward`` takes through ``*args`` or ``**kwargs`` given a name of its
    own while exporting: ``forward(self, pixel_values, **kwargs)`` given ``labels``, a
    wrapper's ``forward(self, *args, **kwargs)`` (keras' torch backend, peft-style
    wrappers). torch 2.13's export matches dynamic shapes against the inputs nested under
    ``kwargs`` in one place and flat in another, and fails either way ("Must provide a
    tree_name"), and wants the positional ones as one tuple for ``*args`` (the batch fixed
    at the example's, as if the model's code fixed it). The instance's ``forward`` is
    shadowed by one whose signature names each input (``args_0``, ... as export names
    them) and which calls the class's own ``forward``; parameter names and module paths are
    unchanged."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, kind)]
    star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    extra_args = star is not None and len(args) > len(positional)
    extra_kwargs = any(p.kind == p.VAR_KEYWORD for p in params) and not set(kwargs) <= named
    if not (extra_args or extra_kwargs) or "forward" in vars(model):
        yield
        return
    cls_forward = type(model).forward

    def forward(*a, **kw):
        return cls_forward(model, *a, **kw)
    names = (positional + [f"{star}_{i}" for i in range(len(args) - len(positional))]
             )[:len(args)]
    forward.__signature__ = inspect.Signature([inspect.Parameter(k, kind)
                                               for k in [*names, *kwargs]])
    model.forward = forward
    try:
        yield
    finally:
        del model.forward


@contextlib.contextmanager
def export_kept(model):
    """Around one export of ``model``: records the custom Functions it applies (yielded),
    runs checkpointed code plainly, and leaves the model's state, its buffers' values (which
    draft_export's real-value run writes) and dtypes as they were."""
    with custom_functions.recorded() as applied, custom_functions.checkpoint_off(), \
            state_kept(model), buffer_values_kept(model), unchanging_to_kept(), \
            caches_cleared(model):
        yield applied


def captures(model, args, kwargs) -> bool:
    """torch.export captures ``model`` on these inputs with their sizes static (the last
    route of :func:`.capture._exported`)."""
    try:
        with export_kept(model):
            export_program(model, args, kwargs, True)
    except Exception:  # noqa: BLE001  (any failure: the hint does not apply)
        return False
    return True
