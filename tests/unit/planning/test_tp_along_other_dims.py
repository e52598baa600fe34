"""Vision Mamba's bidirectional mixer (mambapy's ``vim``): one fused x | z projection read
forwards and flipped along the sequence (``xz.flip([1]).chunk(2, -1)``). The flip, answered
by DTensor's strategy, ended the projection's raw features, so the projection's output was
"used both as an evenly split tensor and as a fused tensor" and tp was refused for the whole
model (zoo 12 F23). An op DTensor keeps sharded on its input's dim at the same size moves
values along other dims only: the features stay the linear's, and the fused layout holds
for both readers. Every rank equals the model."""
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch


class BiMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(H, 4 * H), nn.Linear(2 * H, H)

    def forward(self, h):
        xz = self.in_proj(h)
        x, z = xz.chunk(2, dim=-1)
        xb, zb = xz.flip([1]).chunk(2, dim=-1)
        y = F.silu(x) * z + (F.silu(xb) * zb).flip([1])
        return h + self.out_proj(y)


def test_a_flip_along_the_sequence_keeps_the_fused_features():
    torch.manual_seed(0)
    model = BiMixer()
    gm, d = planned(model, x_batch(), 2)
    assert "in_proj.weight" in d.column and "out_proj.weight" in d.row, d.report
    assert d.redistributions == [], d.redistributions
    assert_tp_matches(model, x_batch(), 2, d, gm)
