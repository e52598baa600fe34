"""A norm over a linear's whole output whose output is the residual stream (``y + f(y)``:
torchvision's Swin-V2 ends its PatchMergingV2 with ``norm(reduction(x))``) is left a norm by
passes/norms_over_projections.py. Written out as its means, the seed walk went through it,
paired the reduction as a column with the next block's first linear, and sharded the stream:
a Partial gradient reached the next block's post-norm, an internal error at tp 2 and 4 (zoo
17 Z7)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec

D = 16


class _PostNormBlock(nn.Module):
    """Swin-V2's post-norm, around a pair that a write through a slice keeps whole (its
    ``qkv_bias[length:2 * length].zero_()``): the block's first linear is free to be a row."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.LayerNorm(D)

    def forward(self, x):
        bias = self.fc1.bias.clone()
        bias[:D].zero_()
        h = torch.relu(F.linear(x, self.fc1.weight, bias))
        return x + self.norm(self.fc2(h))


class _MergedThenBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.reduction, self.norm = nn.Linear(2 * D, D), nn.LayerNorm(D)
        self.blocks = nn.ModuleList([_PostNormBlock(), _PostNormBlock()])

    def forward(self, x):
        x = self.norm(self.reduction(x))
        for block in self.blocks:
            x = block(x)
        return x


def test_the_norm_starting_the_stream_stays_a_norm_and_the_blocks_post_norms_are_written_out():
    from pathlib import Path

    from parallelizer.analysis.graph_facts import aten, module_path
    from parallelizer.frontend.capture import capture
    from parallelizer.passes.norms_over_projections import apply_norms_over_projections
    gm = capture(_MergedThenBlocks(), (torch.randn(4, 8, 2 * D),), Path("model.py")).gm
    assert apply_norms_over_projections(gm) == 2
    assert [module_path(n) for n in gm.graph.nodes
            if n.target in (aten.layer_norm.default, aten.native_layer_norm.default)] == ["norm"]


@pytest.mark.parametrize("tp", [2])
def test_a_norm_starting_the_stream_ends_the_walk(tp):
    program = compile_module(_MergedThenBlocks(), (torch.randn(4, 8, 2 * D),),
                             Spec.model_validate({"mesh": {"tp": tp},
                                                  "tensor_parallel": {"allow_replicated": True}}),
                             reference=False)
    assert [n for n in program.notes if n.startswith(f"self-check: {tp} tp rank")], program.notes
