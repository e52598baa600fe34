"""GQA whose kv heads are tiled, ``k.repeat(1, heads // kv, 1, 1)`` (query head h reads kv
head h % kv, as ports of JAX's ``jnp.tile`` write it), not interleaved as repeat_kv does.
A rank's block of query heads reads kv heads of every rank, so the repeat reads k and v
gathered and attention cuts the tiled heads to the rank's block; q and the output
projection stay sharded. Main before: the tiled (strided) heads met q's plain shard at
attention and the whole attention was kept replicated. Each rank equals the unmodified
model (outputs, every gradient, one SGD step; fp32, 1e-5).

einops spells the tile ``repeat(k, 'b kvh n d -> b (r kvh) n d')``: an unsqueeze, an expand
of the new outer dim and a reshape merging it (x-transformers' GQA). Capture reads that as
the ``repeat`` it is (frontend/tiles.py); before, its attention was kept replicated (4 of 12
matrices sharded in x-transformers' ``Decoder(attn_kv_heads=2)`` at tp2, now 12 of 12). The
interleave (transformers' ``repeat_kv``: the new dim inside) stays an expand."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, captured, x_batch

HEADS, KV, D = 4, 2, 8


def _tile(t, r: int, spelling: str):
    if spelling == "repeat":
        return t.repeat(1, r, 1, 1)
    b, kv, n, d = t.shape
    return t.unsqueeze(1).expand(b, r, kv, n, d).reshape(b, r * kv, n, d)  # einops' repeat


class TiledGQA(nn.Module):
    def __init__(self, spelling: str = "repeat"):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, KV * D), nn.Linear(H, KV * D)
        self.o = nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k = _tile(self.k(x).view(b, t, KV, D).transpose(1, 2), HEADS // KV, self.spelling)
        v = _tile(self.v(x).view(b, t, KV, D).transpose(1, 2), HEADS // KV, self.spelling)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("tp, spelling", [(2, "repeat"), (4, "repeat"), (2, "expand")])
def test_tiled_kv_heads_are_gathered_before_the_repeat_and_cut_at_attention(tp, spelling):
    torch.manual_seed(0)
    model = TiledGQA(spelling)
    gm, d = planned(model, x_batch(), tp)
    assert {"q.weight", "up.weight"} <= d.column and {"o.weight", "down.weight"} <= d.row
    cuts = [r for r in d.redistributions if "scaled_dot_product_attention" in r.readers[0]]
    assert len(cuts) == 2 and all(r.kind == "scatter" for r in cuts), d.report
    assert not any(line.startswith("kept replicated") for line in d.report), d.report
    assert_tp_matches(model, x_batch(), tp, d, gm)


def test_the_interleave_stays_an_expand():
    class Interleaved(TiledGQA):
        def forward(self, x):
            b, t, _ = x.shape
            k = self.k(x).view(b, t, KV, D).transpose(1, 2)
            return k[:, :, None].expand(b, KV, HEADS // KV, t, D).reshape(b, HEADS, t, D)

    targets = {n.target for n in captured(Interleaved(), x_batch()).gm.graph.nodes}
    assert torch.ops.aten.expand.default in targets
    assert torch.ops.aten.repeat.default not in targets
    tiled = {n.target for n in captured(TiledGQA("expand"), x_batch()).gm.graph.nodes}
    assert torch.ops.aten.repeat.default in tiled and torch.ops.aten.expand.default not in tiled
