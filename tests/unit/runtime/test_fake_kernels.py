"""torch.istft in the compile's fake forwards (runtime/fake_kernels.py).

torch 2.13's istft kernel reads its window's values (``aten.equal``, then data no fake
tensor holds), so the rank check of a model ending in ``torch.istft`` (BS-RoFormer, Mel-
RoFormer: music source separation) was an internal error at every tp (zoo 13 Z13). Under
the fake forwards it is now shaped by its documented output length."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from parallelizer import compiler
from parallelizer.frontend.spec import Spec
from parallelizer.runtime.fake_kernels import fake_forward_kernels


@pytest.mark.parametrize("shape, n_fft, hop, center, length", [
    ((4, 33, 33), 64, 16, True, None), ((33, 10), 64, 16, False, None),
    ((2, 33, 10), 64, 16, True, 100), ((2, 17, 9), 32, None, True, None)])
def test_the_fake_istft_has_the_eager_shape_and_dtype(shape, n_fft, hop, center, length):
    spec = torch.randn(shape, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    window = torch.hann_window(n_fft) if center else torch.ones(n_fft)
    args = (n_fft, hop, n_fft, window, center, False, None, length)
    want = torch.ops.aten.istft.default(spec, *args)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode, \
            fake_forward_kernels():
        got = torch.ops.aten.istft.default(mode.from_tensor(spec), *args)
    assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype)


class SpectrogramMask(nn.Module):
    """stft, an MLP mask on the spectrogram, istft: a source separator's outline."""

    def __init__(self, n_fft=64, hop=16):
        super().__init__()
        self.kw = dict(n_fft=n_fft, hop_length=hop, win_length=n_fft)
        f = n_fft // 2 + 1
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * f, 128), nn.GELU(), nn.Linear(128, 2 * f))

    def forward(self, audio):
        s = torch.stft(audio, **self.kw, window=self.window, return_complex=True)
        x = torch.view_as_real(s).permute(0, 2, 1, 3).flatten(2)
        m = self.mlp(x).unflatten(2, (-1, 2)).permute(0, 2, 1, 3).contiguous()
        return torch.istft(s * torch.view_as_complex(m), **self.kw, window=self.window)


def test_a_model_ending_in_istft_compiles_and_passes_the_self_check():
    torch.manual_seed(0)
    batch = (torch.randn(4, 512, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(SpectrogramMask(), batch,
                                      Spec.model_validate({"mesh": {"tp": 2}}),
                                      loss_fn=lambda out, b: out.pow(2).mean())
    dims = {fqn: t.tp_dim for fqn, t in program.plan.tensors.items() if t.tp_dim is not None}
    assert dims == {"mlp.0.weight": 0, "mlp.0.bias": 0, "mlp.2.weight": 1}, dims
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes
