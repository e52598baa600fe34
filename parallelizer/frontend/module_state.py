"""A model's module state put back after the compiler ran it: capture (torch.export runs
the model's own forward on fake tensors) and the eager checks (the numerics self-check) must
leave the user's model as they found it.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch

from .source_lines import in_torch


@contextlib.contextmanager
def state_kept(model: torch.nn.Module, tensors: bool = True):
    """Every submodule's parameters, buffers and attributes as they were before, after the
    block (the same objects; a buffer written in place keeps its new values: the eager
    checks put those back themselves). Export runs the module's own forward on fake
    tensors, and a forward that caches a value into its module (x-transformers' ALiBi
    registers its bias as a buffer on first use) left a FakeTensor in the user's model,
    which every later eager run (the numerics self-check, the reference) then failed on.
    Attributes other than tensors too: rotary-embedding-torch records the length of the
    table it caches into a buffer (``cached_freqs_seq_len``); the self-check's eager run put
    the buffer back but kept the length, and the reference step then rotated by a table of
    zeros: ``--verify`` FAILed a right program (zoo 12 F12). ``tensors=False`` leaves the
    tensor attributes as the block leaves them (the self-check's eager run: a tensor a
    forward keeps for the next call is what the reference step then refuses as carried
    state, naming it)."""
    saved = [(m, dict(m._parameters), dict(m._buffers),
              {k: v for k, v in vars(m).items() if k not in _MODULE_TABLES
               and (tensors or not isinstance(v, torch.Tensor))})
             for m in model.modules()]
    try:
        yield
    finally:
        for m, params, buffers, attrs in saved:
            for now, before in ((m._parameters, params), (m._buffers, buffers)):
                if now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()):
                    now.clear()
                    now.update(before)
            for k in [k for k, v in vars(m).items() if k not in attrs and k not in _MODULE_TABLES
                      and (tensors or not isinstance(v, torch.Tensor))
                      and (isinstance(v, torch.Tensor) or not k.startswith("_"))]:
                delattr(m, k)
            for k, v in attrs.items():
                now = vars(m).get(k)
                if now is not v and (tensors or not isinstance(now, torch.Tensor)):
                    object.__setattr__(m, k, v)


@contextlib.contextmanager
def buffer_values_kept(model: torch.nn.Module):
    """Every buffer's values as they were before, after a block that runs the model on real
    tensors: ``torch.export.draft_export`` propagates real values beside the fake ones, and
    the python_rng check runs one eager forward. A lazily initialised buffer (routing-
    transformer's k-means ``initted`` and ``means``, set from the first batch) was written
    there, the capture then took the initialised branch, and the checkpoint held centroids
    from the example batch (zoo 16 Z9). The copy goes back into the same tensor wherever the
    values differ: routing-transformer writes through ``.data``, which leaves ``_version``
    where it was."""
    with torch.no_grad():
        saved = [(b, b._version, b.detach().clone()) for b in _buffers(model)]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, version, value in saved:
                if not b.is_inference() and _written(b, version, value):
                    b.copy_(value)


def _written(b: torch.Tensor, version: int, value: torch.Tensor) -> bool:
    """``b`` no longer holds ``value``: its version moved, or (a dense tensor written
    through ``.data``, which keeps the version) its values differ."""
    return b._version != version or b.layout == torch.strided and not torch.equal(b, value)


def _buffers(model: torch.nn.Module) -> list:
    """Each distinct real buffer tensor of ``model`` once (fake or meta ones hold no values)."""
    seen, out = set(), []
    for b in model.buffers():
        if type(b) is torch.Tensor and id(b) not in seen and b.device.type != "meta":
            seen.add(id(b))
            out.append(b)
    return out


# the tables nn.Module keeps its parameters, buffers and children in (restored as tables)
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


@contextlib.contextmanager
def unchanging_to_kept():
    """``Module.to(...)`` that would change no parameter or buffer returns the module as it
    is while the block runs. SwitchTransformers' router casts its classifier in forward
    (``self.classifier = self.classifier.to(self.dtype)``, a no-op in fp32); under
    torch.export ``_apply`` tries to swap each parameter for a fake copy and fails
    ("_apply(): Couldn't swap Linear.weight"), a refusal of the whole model (zoo 14 F5). A
    cast that does change a tensor still runs, and export says what it says."""
    to = torch.nn.Module.to

    def kept_to(self, *args, **kwargs):
        device, dtype, _non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(self.parameters()) + list(self.buffers())
        if fmt is None and all(_unchanged_by(t, device, dtype) for t in tensors):
            return self
        return to(self, *args, **kwargs)

    torch.nn.Module.to = kept_to
    try:
        yield
    finally:
        torch.nn.Module.to = to


def _unchanged_by(t: torch.Tensor, device, dtype) -> bool:
    if device is not None and t.device != torch.device(device):
        return False
    # Module.to casts floating-point (and complex) tensors only
    return dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype


@contextlib.contextmanager
def caches_cleared(model: torch.nn.Module):
    """The ``functools.lru_cache`` / ``functools.cache`` functions of the modules defining the
    model's classes (outside torch) emptied before and after a capture. A cached tensor
    builder (yet-another-retnet's ``@lru_cache _build_decay_gammas(num_heads, device,
    dtype)``) called while exporting keeps the FakeTensor it made, and the model's every later
    run returned FakeTensors (the self-check then failed with a raw traceback; zoo 18 Z9).
    Emptied, a cache refills on the next real call with the value it would have held."""
    caches = _lru_caches(model)
    for c in caches:
        c.cache_clear()
    try:
        yield
    finally:
        for c in caches:
            c.cache_clear()


def _lru_caches(model: torch.nn.Module) -> list:
    """The lru_cache wrappers at module level or in a class body of the model's modules."""
    seen, out = set(), []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        mod = sys.modules.get(cls.__module__)
        path = getattr(mod, "__file__", None)
        if mod is None or id(mod) in seen or not path or in_torch(path):
            continue
        seen.add(id(mod))
        own = [v for v in vars(mod).values() if getattr(v, "__module__", None) == mod.__name__]
        for value in own + [v for k in own if isinstance(k, type) for v in vars(k).values()]:
            value = getattr(value, "__func__", value)  # a staticmethod / classmethod
            if isinstance(value, functools._lru_cache_wrapper) and value not in out:
                out.append(value)
    return out
