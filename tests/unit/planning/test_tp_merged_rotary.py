"""fairseq's attention layout (ESM-2, fair-esm 2.0: ``q.view(T, B * H, D).transpose(0, 1)``,
then ``torch.bmm`` per (batch, head)) with ESM's rotary embedding, whose rotate_half cuts
head_dim by ``chunk(2, dim=-1)``. The (batch, heads) merge of the rank's heads was not
carried through the chunk (a multi-output op), so rotate_half's half met ``x * cos`` as a
plain shard: "a (batch, heads) merged dim meets a dim sharded another way", and every
attention projection stayed replicated (zoo 12 F2: ESM-2 4 of 12 matrices at tp 2 and 4).
The merge now follows each piece of a chunk along another dim: 8 of 8 here, no
redistribution, and every rank equals the unmodified model (outputs, every gradient, one
SGD step; fp32)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H

HEADS = 4


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FairseqAttention(nn.Module):
    """Time-first input (T, B, E) as fairseq and ESM keep it."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(H, H) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        d = H // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.arange(16).float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def rotary(self, x):
        cos, sin = self.cos[:, : x.shape[-2], :], self.sin[:, : x.shape[-2], :]
        return x * cos + _rotate_half(x) * sin

    def forward(self, x):
        t, b, e = x.shape
        d = e // HEADS
        q, k, v = ((p(x) * (d ** -0.5 if p is self.q else 1.0)).contiguous()
                   .view(t, b * HEADS, d).transpose(0, 1) for p in (self.q, self.k, self.v))
        q, k = self.rotary(q), self.rotary(k)
        w = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        y = torch.bmm(w, v).transpose(0, 1).contiguous().view(t, b, e)
        x = x + self.out(y)
        return x + self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("tp", [2, 4])
def test_fairseq_merged_heads_pass_esm_rotary(tp):
    torch.manual_seed(0)
    model = FairseqAttention()
    batch = (torch.randn(6, 2, H, generator=torch.Generator().manual_seed(1)),)
    gm, d = planned(model, batch, tp)
    assert {"q.weight", "k.weight", "v.weight", "fc1.weight"} <= d.column, d.report
    assert {"out.weight", "fc2.weight"} <= d.row, d.report
    assert d.redistributions == [], d.redistributions
    assert_tp_matches(model, batch, tp, d, gm)
