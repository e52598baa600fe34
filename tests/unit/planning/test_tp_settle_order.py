"""A rotary table met by a one-head kv part that the first propagation split evenly.
litgpt's multi-query attention (``n_query_groups=1``, Falcon-7B's config) projects q|k|v
in one linear, splits it by sizes and ropes k through ``k[..., :rope_n_elem]``. The first
propagation assumes the even split, which cuts k's one head along head_dim, and asked for
the cos table cut along head_dim too; the next one found the copied one-head layout, but
the stale cut of cos kept ending those copies, so every block's fused q|k|v was kept whole
on every rank (litgpt's Falcon 6 of 8 matrices at tp2 and tp4, zoo 11 F2). The planner now
settles layouts before it asks for per-head cuts. Each rank equals the unmodified model
(outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch

HEADS, D = 4, 8


def _rope(x, cos, sin):  # litgpt.model.apply_rope
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MultiQuery(nn.Module):
    def __init__(self, groups: int = 1):
        super().__init__()
        self.groups = groups
        self.qkv = nn.Linear(H, (HEADS + 2 * groups) * D, bias=False)
        self.proj = nn.Linear(HEADS * D, H, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((HEADS * D, self.groups * D, self.groups * D), dim=-1)
        q = q.view(b, t, HEADS, D).transpose(1, 2)
        k = k.view(b, t, self.groups, D).transpose(1, 2)
        v = v.view(b, t, self.groups, D).transpose(1, 2)
        q = torch.cat((_rope(q[..., :D], cos, sin), q[..., D:]), dim=-1)
        k = torch.cat((_rope(k[..., :D], cos, sin), k[..., D:]), dim=-1)
        k = k.repeat_interleave(HEADS // self.groups, dim=1)
        v = v.repeat_interleave(HEADS // self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, HEADS * D))


class Model(nn.Module):
    def __init__(self, groups: int = 1):
        super().__init__()
        self.attn = nn.ModuleList(MultiQuery(groups) for _ in range(2))
        angles = torch.arange(16.0)[:, None] * torch.linspace(0.1, 1.0, D)[None]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        cos, sin = self.cos[:t].unsqueeze(0), self.sin[:t].unsqueeze(0)
        for attn in self.attn:
            x = x + attn(x, cos, sin)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_one_head_kv_part_is_copied_through_rotary(tp):
    torch.manual_seed(0)
    model = Model()
    gm, d = planned(model, x_batch(), tp)
    assert d.column == {"attn.0.qkv.weight", "attn.1.qkv.weight"}, d.report
    assert d.row == {"attn.0.proj.weight", "attn.1.proj.weight"}, d.report
    assert "replicated_heads (1 kv heads" in d.layouts["attn.0.qkv.weight"].text(), d.report
    assert d.warnings == [] and d.redistributions == [], d.report
    assert_tp_matches(model, x_batch(), tp, d, gm)
