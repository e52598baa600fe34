"""A pair through a norm within the block whose row's output reaches the residual through a
layer scale (a product with a parameter) and a drop path (a per-sample mask drawn into
``x.new_empty``): timm's EVA SwiGLU MLP with ``scale_mlp``, whose fc1_g, fc1_x and fc2 stayed
replicated, "no column/row pair found" (zoo 17 Z6; planning/residual_stream.py
``ends_block``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec

D, H = 16, 32


class _SwiGLUBlock(nn.Module):
    def __init__(self, drop_path: bool):
        super().__init__()
        self.norm1, self.norm = nn.LayerNorm(D), nn.LayerNorm(H)
        self.fc1_g, self.fc1_x, self.fc2 = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)
        self.gamma, self.drop_path = nn.Parameter(torch.full((D,), 0.1)), drop_path

    def forward(self, x):
        h = self.norm1(x)
        h = self.gamma * self.fc2(self.norm(F.silu(self.fc1_g(h)) * self.fc1_x(h)))
        if self.drop_path:
            keep = h.new_empty((h.shape[0], 1, 1)).bernoulli_(0.9)
            h = h.div(0.9) * keep
        return x + h


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_SwiGLUBlock(False), _SwiGLUBlock(True)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_layer_scaled_swiglu_with_an_inner_norm_shards_every_matrix(tp):
    program = compile_module(_Stack(), (torch.randn(4, 8, D),),
                             Spec.model_validate({"mesh": {"tp": tp}}), reference=False)
    assert "6 of 6 weight matrices in blocks sharded" in program.report, program.report
    assert [n for n in program.notes if n.startswith(f"self-check: {tp} tp rank")], program.notes
