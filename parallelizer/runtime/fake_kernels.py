"""Modes for the compile's fake forwards (emit/rank_check.py, advisor/activations.py): ops
whose CPU kernel the fake tensors cannot run as it is, run with the same output shape and
dtype. A model compiled without weights is captured on the meta device, where its code may
take the branch written for a device other than the CPU, whose ops CPU kernels refuse; and
some kernels read values no fake tensor holds.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def fake_forward_kernels():
    """Ops the fake forwards cannot run as they are, run so that shapes and dtypes are right:

    - ``aten.histc`` of an integer tensor, run on its float copy and cast back (same
      (bins,) shape): transformers' MoE counts rows per expert with ``histc`` of the integer
      ids off the CPU and of their float copy on it; CPU kernels refuse integer ``histc``;
    - ``aten.istft`` of fake tensors, by its output shape: torch 2.13's kernel (composite, so
      decomposed before any dispatch mode sees it) reads its window's values (``aten.equal``,
      then data no fake tensor has), and the rank check of a model ending in ``torch.istft``
      (BS-RoFormer, source separation) was an internal error (zoo 13 Z13); the values are the
      self-check's and ``--verify``'s to compare."""
    with _ShapedIstft(), _IntegerHistcOnFloat():
        yield


class _IntegerHistcOnFloat(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


class _ShapedIstft(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.istft.default and isinstance(args[0], FakeTensor):
            return _istft_like(*args, **kwargs)
        return func(*args, **kwargs)


def _istft_like(x, n_fft, hop_length=None, win_length=None, window=None, center=True,
                normalized=False, onesided=None, length=None, return_complex=False):
    """An empty tensor shaped as ``torch.istft``'s output of ``x`` ``(batch?, freq, frames)``:
    ``length`` samples, else ``n_fft + hop * (frames - 1)`` less ``n_fft // 2`` at each end
    when ``center`` (torch.istft's documentation)."""
    hop = hop_length if hop_length is not None else (win_length or n_fft) // 4
    if length is None:
        length = n_fft + hop * (x.shape[-1] - 1) - (2 * (n_fft // 2) if center else 0)
    dtype = x.dtype if return_complex else x.dtype.to_real()
    return torch.empty((*x.shape[:-2], length), dtype=dtype, device=x.device)
