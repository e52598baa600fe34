"""A column_parallel bias written through a slice of its copy before the product: torchvision's
Swin-V2 attention drops k's bias by ``b = qkv.bias.clone(); b[C:2 * C].zero_()`` and then
``F.linear(x, qkv.weight, b)``. The slice was no cut of the linear's features to the planner
(only slices of the output were), so the write through it could not be placed and attention
stayed replicated (torchvision Swin-V2: 8 of 12 matrices at tp2). Now a slice of a column
bias's path cuts the output features as a slice of the output does: the bounds become each
rank's local bounds (``[C / tp, 2C / tp)`` of the rank's q|k|v), attention is sharded, and
every tp rank equals the unmodified model (the compile's self-check). A slice on no part
boundary the layout can keep (``b[:5]``) keeps that attention whole, named in the notes.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

C, H = 32, 4


class _NoKBias(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.cut = cut
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc1, self.fc2 = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)

    def forward(self, x):
        b, t, _ = x.shape
        bias = self.qkv.bias.clone()
        bias[self.cut].zero_()
        qkv = F.linear(x, self.qkv.weight, bias).reshape(b, t, 3, H, C // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
        return x + self.fc2(F.gelu(self.fc1(x)))


def _compile(cut, tp):
    torch.manual_seed(0)
    model = nn.Sequential(_NoKBias(cut), _NoKBias(cut))
    batch = (torch.randn(2, 8, C, generator=torch.Generator().manual_seed(1)),)
    return compiler.compile_module(model, batch, Spec.model_validate({"mesh": {"tp": tp}}),
                                   reference=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_bias_slice_written_in_place_is_cut_with_the_features(tp):
    program = _compile(slice(C, 2 * C), tp)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(rf"self-check: {tp} tp rank\(s\) of the program against the model", note), note
    for i in (0, 1):
        assert program.plan.tensors[f"{i}.qkv.weight"].role == "column_parallel"
        assert program.plan.tensors[f"{i}.qkv.bias"].tp_dim == 0
        assert program.plan.tensors[f"{i}.proj.weight"].role == "row_parallel"
    assert "tensor parallel: 8 of 8 weight matrices in blocks sharded" in "\n".join(program.notes)


def test_a_bias_slice_off_the_layout_keeps_that_attention_whole():
    program = _compile(slice(0, 5), 2)
    notes = "\n".join(program.notes)
    assert program.plan.tensors["0.qkv.weight"].role != "column_parallel"
    assert program.plan.tensors["0.fc1.weight"].role == "column_parallel"
    assert "tp = 2 does not divide the 5 features" in notes, notes
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), notes
