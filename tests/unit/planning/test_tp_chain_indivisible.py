"""A chain head tp does not divide beside a feed-forward tp does not divide
(planning/tp_chains.chains_whole). recurrent-memory-transformer's hyper-connections mix 4
residual streams by a linear of 5 outputs (``dynamic_alpha_fn``) before attention, and its
GEGLU is 170 wide: at tp 2 the mixer is kept whole (the head of a chain) and the rest
sharded; at tp 4 neither plan divided, the plan with the mixer as a column went on, the
feed-forward's size kept its groups whole, and the attention the mixer pairs with with them:
the model was refused, "no weight matrix could be sharded" (zoo 13 Z19). Now the plan with
the chain head whole goes on: attention sharded, the feed-forward whole (warned), every rank
equal to the unmodified model (outputs, every gradient, one SGD step; fp32)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H

HEADS, STREAMS, FF = 4, 4, 6  # FF: 2 divides it, 4 does not


class MixedStreams(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha_fn = nn.Linear(H, STREAMS + 1, bias=False)
        self.static_alpha = nn.Parameter(torch.randn(STREAMS, STREAMS + 1) * 0.1)
        self.q, self.kv, self.o = nn.Linear(H, H), nn.Linear(H, 2 * H), nn.Linear(H, H)
        self.ff1, self.ff2 = nn.Linear(H, 2 * FF), nn.Linear(FF, H)

    def forward(self, streams):  # (b, n, streams, H)
        alpha = self.alpha_fn(F.normalize(streams, dim=-1)) + self.static_alpha
        mixed = torch.einsum("bnst,bnsd->bntd", alpha, streams)
        h, rest = mixed[:, :, 0], mixed[:, :, 1:]
        b, n, _ = h.shape
        q = self.q(h).view(b, n, HEADS, -1).transpose(1, 2)
        k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.kv(h).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, H)
        h = h + self.o(y)
        a, g = self.ff1(h).chunk(2, -1)
        h = h + self.ff2(a * F.gelu(g))
        return rest + h[:, :, None]


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_stays_sharded_beside_an_indivisible_chain_head_and_feed_forward(tp):
    torch.manual_seed(0)
    batch = (torch.randn(2, 5, STREAMS, H, generator=torch.Generator().manual_seed(1)),)
    d = plan_and_check(MixedStreams(), batch, tp)
    assert {"q.weight", "kv.weight"} <= d.column and "o.weight" in d.row, d.report
    assert "alpha_fn.weight" not in d.column | d.row
    assert ({"ff1.weight", "ff2.weight"} <= d.column | d.row) == (tp == 2), d.report
