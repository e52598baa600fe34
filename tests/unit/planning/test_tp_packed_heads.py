"""local-attention's windowed attention (local-attention 1.11, ``LocalAttention.forward``):
q, k, v ``(b, h, n, d)`` packed with einops ``pack([t], '* n d')`` (a reshape to ``(b * h, n,
d)`` and a ``cat`` of that one tensor), bucketed into windows, the previous window looked up
by ``pad`` + ``unfold``, and unpacked by a slice ``[0:b * h]`` of the merged dim before the
view back to ``(b, h, n, d)``. The one-tensor cat, ``unfold`` and the slice each kept the
attention replicated (zoo 12 F19): the cat is now the copy it is (capture), ``unfold`` keeps
every dim but the windowed one, and a slice to the dim's own size is whole on every rank.
8 of 8 matrices sharded, no redistribution, every rank equal to the unmodified model
(outputs, every gradient, one SGD step; fp32)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H

HEADS, WINDOW = 4, 4


def _look_back(t):
    """(bh, w, n, d) -> (bh, w, 2n, d): each window with the one before it."""
    t = F.pad(t, (0, 0, 0, 0, 1, 0), value=-1.0)
    return t.unfold(1, 2, 1).permute(0, 1, 4, 2, 3).flatten(2, 3)


class PackedLocalAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        packed = q.shape[:-2]
        q, k, v = (torch.cat([t.reshape(-1, n, t.shape[-1])], dim=0) for t in (q, k, v))
        bq, bk, bv = (t.view(t.shape[0], n // WINDOW, WINDOW, -1) for t in (q, k, v))
        bk, bv = _look_back(bk), _look_back(bv)
        w = torch.einsum("bwid,bwjd->bwij", bq, bk).softmax(-1)
        y = torch.einsum("bwij,bwjd->bwid", w, bv).flatten(1, 2)
        y = y[0:packed.numel()].view(*packed, n, -1)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, -1))
        return x + self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("tp", [2, 4])
def test_packed_windowed_attention_is_sharded_over_heads(tp):
    torch.manual_seed(0)
    model = PackedLocalAttention()
    batch = (torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1)),)
    gm, d = planned(model, batch, tp)
    assert {"qkv.weight", "fc1.weight"} <= d.column, d.report
    assert {"out.weight", "fc2.weight"} <= d.row, d.report
    assert d.redistributions == [], d.redistributions
    assert_tp_matches(model, batch, tp, d, gm)
