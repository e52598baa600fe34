"""GQA's kv heads repeated by ``flatten`` instead of ``reshape``: torchtune's
MultiHeadAttention writes ``k.unsqueeze(2).expand(b, kv, heads // kv, t, d).flatten(1, 2)``
(query head h reads kv head h // (heads / kv), transformers' repeat_kv order), and a tile by
a new outer dim can be spelled ``unsqueeze(1).expand(b, r, kv, t, d).flatten(1, 2)``. Both
shard as their reshape spellings do (the tile is read as ``repeat``: frontend/tiles.py). Main before: at tp above the kv heads (tp4, 2 kv heads)
the copied kv heads met the flatten and k/v were kept whole ("no rule keeps a copy of one
head on each rank"; 4 of 8 matrices of torchtune's Llama 3.1 attention sharded, zoo 11 F1).
Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch

HEADS, KV, D = 4, 2, 8


def _repeat(t, r: int, order: str):
    b, kv, n, d = t.shape
    if order == "interleave":  # torchtune
        return t.unsqueeze(2).expand(b, kv, r, n, d).flatten(1, 2)
    return t.unsqueeze(1).expand(b, r, kv, n, d).flatten(1, 2)


class FlattenGQA(nn.Module):
    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, KV * D), nn.Linear(H, KV * D)
        self.o = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k = _repeat(self.k(x).view(b, t, KV, D).transpose(1, 2), HEADS // KV, self.order)
        v = _repeat(self.v(x).view(b, t, KV, D).transpose(1, 2), HEADS // KV, self.order)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


@pytest.mark.parametrize("tp, order", [(2, "interleave"), (4, "interleave"), (2, "tile"),
                                       (4, "tile")])
def test_kv_heads_repeated_by_flatten_are_sharded(tp, order):
    torch.manual_seed(0)
    model = FlattenGQA(order)
    gm, d = planned(model, x_batch(), tp)
    assert {"q.weight"} <= d.column and {"o.weight"} <= d.row, d.report
    if order == "interleave":  # each rank its kv head(s), split or copied
        assert {"k.weight", "v.weight"} <= d.column, d.report
        assert not any(line.startswith("kept") for line in d.report), d.report
    else:  # the tile read as the repeat it is (test_tp_tiled_kv.py): cut at attention
        assert torch.ops.aten.repeat.default in {n.target for n in gm.graph.nodes}
        cuts = [r for r in d.redistributions if "scaled_dot_product_attention" in r.readers[0]]
        assert len(cuts) == 2 and not any(line.startswith("kept replicated")
                                          for line in d.report), d.report
    assert_tp_matches(model, x_batch(), tp, d, gm)
