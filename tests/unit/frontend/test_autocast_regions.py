"""``torch.autocast(device, enabled=False)`` regions in forward (x-transformers keeps its
rotary embedding in fp32 with a decorator that opens one): torch.export keeps each as a
``wrap_with_autocast`` subgraph, which capture refused ("the model calls wrap_with_autocast on
a subgraph"), so every x-transformers model with rotary embeddings was refused. In fp32 no
autocast is active, so the region's ops compute what they compute anywhere: the capture
enters it as the no-op it is and the program checks against the model at tp 2. Under mixed
precision the program's own autocast would reach into the region, so that compile is refused
naming the region's line and the spec key. A region that turns autocast on stays refused.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.errors import CaptureError
from parallelizer.frontend.spec import Spec

D, H = 32, 4


def _rotate(x, freqs):
    with torch.autocast(x.device.type, enabled=False):  # the rotary line
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Rotary(nn.Module):
    def __init__(self, enabled: bool = False):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, D // H, 2) / (D // H)))
        self.enabled = enabled

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        with torch.autocast("cpu", enabled=False):  # the table, kept in fp32
            freqs = torch.einsum("i,j->ij", torch.arange(t, dtype=torch.float32), self.inv_freq)
        freqs = torch.cat((freqs, freqs), -1) if not self.enabled else freqs
        if self.enabled:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                q = q * 2
        else:
            q, k = _rotate(q, freqs[:, : D // H // 2]), _rotate(k, freqs[:, : D // H // 2])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, D))


def _batch():
    return (torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)),)


def _spec(**extra):
    return Spec.model_validate({"mesh": {"tp": 2}, **extra})


def test_autocast_off_regions_are_inlined_and_the_program_checks():
    torch.manual_seed(0)
    model = nn.Sequential(_Rotary(), _Rotary())
    program = compiler.compile_module(model, _batch(), _spec(), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert program.plan.tensors["0.qkv.weight"].tp_dim == 0
    assert "wrap_with_autocast" not in "".join(program.sources.values())


def test_mixed_precision_over_an_autocast_off_region_is_refused_naming_its_line():
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as e:
        compiler.compile_module(_Rotary(), _batch(),
                                _spec(mixed_precision={"param_dtype": "bf16"}), reference=False)
    assert re.search(r"the model turns autocast off at test_autocast_regions\.py:\d+, "
                     r"test_autocast_regions\.py:\d+ .*mixed_precision\.param_dtype=bf16 .*Set "
                     r"mixed_precision\.param_dtype=fp32", str(e.value)), str(e.value)


def test_a_region_turning_autocast_on_is_still_refused():
    """Named as what the user wrote, with the spec key doing it (it said "calls
    wrap_with_autocast on a subgraph", torch.export's name; zoo 18 Z3)."""
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"turns autocast on \(cpu, bfloat16\) at "
                                           r"test_autocast_regions\.py:\d+; .*remove the "
                                           r"torch\.autocast region and set "
                                           r"mixed_precision\.param_dtype=bf16"):
        compiler.compile_module(_Rotary(enabled=True), _batch(), _spec(), reference=False)


class _Nested(nn.Module):
    """ring-attention-pytorch's rotary: an autocast-off forward calling an autocast-off
    function. The inner region is a submodule of the outer region's subgraph: inlining the
    outer one copied a get_attr of a name the model's graph does not hold, and the graph's
    lint raised a bare RuntimeError (zoo 21 F1)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.register_buffer("inv_freq", torch.arange(D // 2).float() / D)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            freqs = torch.outer(torch.arange(x.shape[1]).float(), self.inv_freq)
            x = _rotate(x, freqs)
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_regions_nested_in_an_inlined_region_are_inlined_too():
    torch.manual_seed(0)
    model = nn.Sequential(_Nested(), _Nested())
    program = compiler.compile_module(model, _batch(), _spec(), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert program.plan.tensors["0.fc1.weight"].tp_dim == 0
    assert "wrap_with_autocast" not in "".join(program.sources.values())


class _NoGradInside(nn.Module):
    """A ``torch.no_grad()`` inside an autocast-off region: torch.export's region lost it
    (its ops ran with gradient), and the self-check stopped the compile as an internal
    error, "the program computes one where the model's is None" (decision 222)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            with torch.no_grad():
                s = self.scale * 2
            x = x * s
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_no_grad_inside_an_autocast_off_region_keeps_the_parameter_out_of_the_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(_NoGradInside(), _NoGradInside())
    program = compiler.compile_module(model, _batch(), _spec(), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert program.plan.tensors["0.fc1.weight"].tp_dim == 0
    with pytest.raises(CaptureError, match=r"turns autocast off at test_autocast_regions\.py:"
                                           r"\d+ .*param_dtype=bf16"):
        compiler.compile_module(model, _batch(), _spec(mixed_precision={"param_dtype": "bf16"}),
                                reference=False)
