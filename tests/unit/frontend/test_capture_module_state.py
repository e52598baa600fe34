"""Capture leaves the user's model as it was. torch.export runs the module's own forward on
fake tensors; a forward that caches a value into its module (x-transformers' ALiBi registers
its bias as a buffer on first use, over a ``None`` placeholder) left a FakeTensor in the
model, and the compile's next eager run of it failed ("the model ... fails on
example_inputs() when it runs as it is ...: DataDependentOutputException: aten.equal.default",
though it runs). Now every parameter, buffer and tensor attribute is the one it was, and such
a cache is no state the program writes: the model compiles at tp 2 and its self-check passes.
"""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec

D, H = 32, 4


class _CachedBias(nn.Module):
    """Attention with a per-head distance bias cached on first use (the x-transformers way)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(H, 1, 1))
        self.register_buffer("bias", None, persistent=False)

    def _bias(self, t):
        if self.bias is not None and self.bias.shape[-1] >= t:
            return self.bias[..., :t, :t]
        pos = torch.arange(t)
        self.register_buffer("bias", -(pos[None, :] - pos[:, None]).abs() * self.slopes,
                             persistent=False)
        self.last = self.bias  # and a plain tensor attribute
        return self.bias

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self._bias(t))
        return x + self.out(y.transpose(1, 2).reshape(b, t, D))


# torch's own advice on the plain tensor attribute the test's forward assigns
pytestmark = pytest.mark.filterwarnings("ignore:The tensor attributes")


def _batch():
    return (torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)),)


def test_capture_keeps_every_tensor_the_model_holds():
    torch.manual_seed(0)
    model = nn.Sequential(_CachedBias(), _CachedBias())
    before = [(m, dict(m._buffers), dict(m._parameters)) for m in model.modules()]
    capture(model, _batch(), Path("model.py"))
    for m, buffers, params in before:
        assert m._buffers.keys() == buffers.keys() and m._parameters.keys() == params.keys()
        assert all(m._buffers[k] is v for k, v in buffers.items()), m._buffers
        assert all(m._parameters[k] is v for k, v in params.items())
        assert "last" not in vars(m)
    assert model[0].bias is None


def test_a_forward_that_caches_a_buffer_compiles_and_checks():
    torch.manual_seed(0)
    model = nn.Sequential(_CachedBias(), _CachedBias())
    program = compiler.compile_module(model, _batch(), Spec.model_validate({"mesh": {"tp": 2}}),
                                      reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert program.plan.tensors["0.qkv.weight"].tp_dim == 0


class _CachedTable(nn.Module):
    """rotary-embedding-torch's cache: a table written into a buffer on first use, with its
    length kept as a plain int attribute that the next call trusts."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(16, D), persistent=False)
        self.table_len = 0
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        t = x.shape[1]
        if self.table_len >= t:
            table = self.table[:t]
        else:
            table = (torch.arange(t, dtype=x.dtype)[:, None] + torch.arange(D) / D).cos()
            self.table[:t] = table.detach()
            self.table_len = t
        return x + self.down(F.gelu(self.up(x * table)))


def test_a_cached_length_is_put_back_after_capture_and_the_self_check():
    """zoo 12 F12: the self-check's eager run put the table buffer back but kept
    ``table_len``, so the reference step read a table of zeros and --verify FAILed a right
    program. Every attribute is now put back: the reference's loss is the fresh model's."""
    torch.manual_seed(0)
    model = nn.Sequential(_CachedTable(), _CachedTable())
    torch.manual_seed(0)
    fresh = nn.Sequential(_CachedTable(), _CachedTable())
    batch = _batch()
    want = fresh(*batch).square().mean()
    program = compiler.compile_module(model, batch, Spec.model_validate({"mesh": {"tp": 2}}),
                                      lambda out, b: out.square().mean())
    assert [m.table_len for m in model] == [0, 0]
    torch.testing.assert_close(program.reference["loss"], want.detach(), rtol=0, atol=0)

