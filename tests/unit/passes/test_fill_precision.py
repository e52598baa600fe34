"""A fill value captured as fp32's extreme (``torch.finfo(scores.dtype).min``, the Hugging
Face mask idiom, captured in fp32 as -3.4e38) follows the filled tensor's dtype under a
bf16 / fp16 ``mixed_precision.param_dtype``: fp16 refused the fp32 value at the program's
first step on every mixed-precision layout (zoo 25 F7)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parallelizer.frontend.capture import capture
from parallelizer.passes.fill_precision import apply_fill_precision


class MaskedScores(nn.Module):
    def forward(self, scores):
        t = scores.shape[-1]
        i = torch.arange(t)
        keep = i[:, None] >= i[None, :]
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min).softmax(-1)


def _captured():
    x = (torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(0)),)
    return capture(MaskedScores(), x, Path(__file__)).gm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fp32_minimum_becomes_the_dtypes_under_mixed_precision(dtype):
    gm = _captured()
    x = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    with pytest.raises(RuntimeError, match="without overflow"):  # as captured
        gm(x)
    assert apply_fill_precision(gm, "fp16" if dtype == torch.float16 else "bf16")
    got = gm(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, MaskedScores()(x))  # the model run in that dtype


def test_fp32_and_values_every_dtype_holds_are_left_alone():
    gm = _captured()
    assert not apply_fill_precision(gm, "fp32")
    assert "in_range_of" not in gm.code
