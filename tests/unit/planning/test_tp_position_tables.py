"""A relative-position bias table read by a gather of its rows, as Swin (and many window
attentions) write it: ``table[index.view(-1)].view(T, T, heads).permute(2, 0, 1)`` added
to the scores as SDPA's mask. The table (relative positions, heads) is traced back through
the permute, the view and the gather, and sharded along its heads dim, so each rank gathers
only its heads' bias: no redistribution, and the ranks equal the unmodified model (outputs,
gradients, one SGD step; fp32, 1e-5). Before, the bias was computed whole on every rank and
cut at SDPA, the table's gradient summed over tp."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H, x_batch

HEADS, D, T = 4, 8, 5


class TableBias(nn.Module):
    """Attention with a learned bias per head and relative position, gathered from a table
    of ``(2T - 1, heads)`` rows by a ``(T * T,)`` index buffer."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(H, H) for _ in range(3))
        self.o = nn.Linear(H, H)
        self.table = nn.Parameter(torch.randn(2 * T - 1, HEADS))
        pos = torch.arange(T)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + T - 1).reshape(-1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = self.table[self.index.view(-1)].view(T, T, -1).permute(2, 0, 1).contiguous()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


@pytest.mark.parametrize("tp", [2, 4])
def test_gathered_position_table_is_sharded_along_heads(tp):
    torch.manual_seed(0)
    d = plan_and_check(TableBias(), x_batch(3, T, seed=1), tp)
    assert {"q.weight", "k.weight", "v.weight"} <= d.column and d.row == {"o.weight"}
    assert d.per_head == {"table": 1} and not d.redistributions
