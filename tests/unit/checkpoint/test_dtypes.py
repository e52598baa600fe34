"""The dtype tables are total over torch's dtypes (issue 23, part 4: a table keyed by a few
dtypes raised ``KeyError: torch.complex64``): every dtype torch defines either has its
safetensors form, written and read back bit for bit, or is refused by name (at compile time
when a model holds one, naming the tensor); autograd's dtypes (floating point and complex)
are the ones the cost model, the advisor and synthetic batches treat as carrying gradient.
parallelizer/plan/dtypes.py, checkpoint/format.py, checkpoint/stream.py."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import _TYPES
from torch import nn

from parallelizer.analysis.graph_costs import collect_costs
from parallelizer.checkpoint.format import (from_stored, safetensors_dtype, stored_dtype,
                                            stored_shape)
from parallelizer.checkpoint.stream import write_streamed
from parallelizer.compiler import compile_module
from parallelizer.errors import CheckpointError, PlanError
from parallelizer.frontend.spec import load_spec
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.plan.dtypes import all_dtypes, differentiable

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS))
from tp_small_models import captured  # noqa: E402
from tp_weight_path_models import ComplexNet, half_batch  # noqa: E402

DTYPES = all_dtypes()


def _allocatable(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental; quantized deprecated
        try:
            return torch.empty(2, 3, dtype=dtype)
        except (RuntimeError, TypeError):
            return None


def test_all_dtypes_is_every_torch_dtype():
    assert len(DTYPES) >= 40
    assert {torch.complex64, torch.complex128, torch.complex32, torch.bfloat16, torch.qint8,
            torch.float8_e8m0fnu, torch.uint16, torch.bits8, torch.uint3} <= set(DTYPES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_has_a_safetensors_form_or_is_refused_by_name(dtype):
    try:
        name = safetensors_dtype(dtype)
    except CheckpointError as e:
        assert str(e).startswith(f"dtype {str(dtype).removeprefix('torch.')} has no "
                                 f"safetensors form"), e
        assert not dtype.is_complex and dtype not in _TYPES.values()
        return
    assert _TYPES[name] == stored_dtype(dtype)  # the name safetensors itself reads back


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _TYPES.values() or d.is_complex],
                         ids=str)
def test_every_storable_dtype_round_trips_bit_for_bit(tmp_path, dtype):
    t = _allocatable(dtype)
    if t is None:
        pytest.skip(f"torch cannot allocate {dtype}")
    bits = torch.arange(6 * t.element_size(), dtype=torch.uint8) * 37 % 251
    bits = bits % 2 if dtype == torch.bool else bits  # a bool byte is 0 or 1
    t = bits.view(dtype).reshape(2, 3) if not dtype.is_complex else \
        torch.view_as_complex(torch.randn(2, 3, 2).to(dtype.to_real()))
    odd = t.t()  # not contiguous: written row by row through the gather buffer
    specs = [("a", (2, 3), dtype), ("b", (3, 2), dtype)]
    write_streamed(tmp_path / "f.safetensors", specs, {"a": t, "b": odd}.__getitem__, {})
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        for name, want in (("a", t), ("b", odd)):
            stored = f.get_tensor(name)
            assert list(stored.shape) == stored_shape(want.shape, dtype)
            got = from_stored(stored, dtype)
            assert got.dtype == dtype and torch.equal(_bytes(got), _bytes(want)), name


def _bytes(t):
    real = torch.view_as_real(t) if t.is_complex() else t
    return real.contiguous().view(-1).view(torch.uint8)


def test_write_names_the_tensor_of_a_dtype_without_a_file_form(tmp_path):
    t = torch.zeros(4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(CheckpointError, match=r"^scales: dtype float8_e8m0fnu has no "):
        write_streamed(tmp_path / "f.safetensors", [("scales", (4,), t.dtype)],
                       lambda _n: t, {})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_differentiable_is_autograds_rule(dtype):
    t = _allocatable(dtype)
    if t is None:
        pytest.skip(f"torch cannot allocate {dtype}")
    try:
        t.requires_grad_()
        tracked = True
    except RuntimeError:
        tracked = False
    assert differentiable(dtype) == tracked


def test_costs_count_the_backward_through_complex_values():
    """Each block of ComplexNet views its complex hidden state as real for two linears: the
    backward is 2x their forward (input and weight gradients). Complex values were taken
    as carrying no gradient, so the first linear's input gradient went uncounted (1.5x)."""
    cap = captured(ComplexNet(), half_batch())
    apply_cleanup(cap.gm)
    costs = collect_costs(cap.gm, tuple(f"layers.{i}" for i in range(4)), {})
    for unit in costs.blocks:
        assert unit.bwd_flops == 2 * unit.fwd_flops > 0, unit


class _MXScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("scales", torch.zeros(8, dtype=torch.uint8).view(torch.float8_e8m0fnu))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * self.scales.float()
        return x


def test_model_holding_a_dtype_without_a_file_form_is_refused_at_compile():
    spec = load_spec(TESTS / "distributed" / "user_models" / "spec.yaml", [])
    with pytest.raises(PlanError) as e:
        compile_module(_MXScales(), (torch.randn(2, 3, 8),), spec)
    msg = str(e.value)
    assert msg.startswith("scales: dtype float8_e8m0fnu has no safetensors form"), msg
    assert "cast it to one of those in build_model()" in msg
