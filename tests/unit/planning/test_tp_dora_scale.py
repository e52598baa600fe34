"""DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", eq. 5): the
output is scaled per feature by ``magnitude / ||W + B A||`` (the norm of each output row),
which torchtune's DoRALinear views ``(1, out_features)``. The planner read that view as one
head of head_dim = out_features and kept the base weight whole ("its output is one head");
torchtune's DoRA Llama 3 sharded 28 of 42 matrices at tp2 (zoo 11 F3), now 38. A view
whose size-1 dim is the outermost is no head: batch or tokens precede heads in every
activation. Each rank equals the unmodified model (outputs, every gradient, one SGD step;
fp32, 1e-5)."""
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch

FFN, RANK = 64, 4


class DoRAUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(FFN, H) * 0.05)
        self.lora_a = nn.Linear(H, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, FFN, bias=False)
        self.magnitude = nn.Parameter(torch.rand(FFN) + 0.5)

    def forward(self, x):
        base = F.linear(x, self.weight)
        lora = self.lora_b(self.lora_a(x))
        norm = torch.linalg.norm(self.weight + self.lora_b.weight @ self.lora_a.weight, dim=1)
        scale = (self.magnitude / norm.detach()).view(1, -1)
        return (scale - 1) * base + scale * lora * 2.0 + base


class DoRAMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = DoRAUp(), nn.Linear(FFN, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def test_dora_per_feature_scale_is_no_head():
    torch.manual_seed(0)
    model = DoRAMLP()
    gm, d = planned(model, x_batch(), 2)
    assert "up.weight" in d.column and "down.weight" in d.row, d.report
    assert d.dims.get("up.magnitude") == 0, d.report
    assert not any("one head" in line for line in d.report), d.report
    assert_tp_matches(model, x_batch(), 2, d, gm)
