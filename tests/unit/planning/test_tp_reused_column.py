"""A column linear called twice: ``a0`` feeds ``b0`` and, read again on the next block's
input, is summed with ``a1``'s output into ``b1`` (a block reusing the first block's
projection, zoo 23's cross-stage share). The seeds kept only the pair of its second call, so
b0, a row no column reached, was a conflict that took every pair with it: "no linear layer
feeds another" at tp2 (zoo 23 F4). A weight called twice pairs with the rows each call
reaches. Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32,
1e-5).

The block form (each block ``x + b(gelu(a(h)) + 0.5 * gelu(shared(h)))`` of its norm ``h``,
``shared`` being block 0's ``a``) was refused the same way: the add of the two branches was
taken for the residual stream, a block's end, so no walk reached a row (zoo 23 F4's
``css_v4``)."""
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import assert_tp_matches, planned
from tp_small_models import H, x_batch


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a0, self.b0 = nn.Linear(H, 64), nn.Linear(64, H)
        self.a1, self.b1 = nn.Linear(H, 64), nn.Linear(64, H)

    def forward(self, x):
        y = x + self.b0(F.gelu(self.a0(x)))
        return y + self.b1(F.gelu(self.a1(y)) + 0.5 * F.gelu(self.a0(y)))


def test_a_column_called_twice_pairs_with_both_rows():
    torch.manual_seed(0)
    model = Reused()
    gm, d = planned(model, x_batch(), 2)
    assert set(d.column) == {"a0.weight", "a1.weight"}, d.report
    assert set(d.row) == {"b0.weight", "b1.weight"}, d.report
    assert_tp_matches(model, x_batch(), 2, d, gm)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n, self.a, self.b = nn.LayerNorm(H), nn.Linear(H, 64), nn.Linear(64, H)

    def forward(self, x, shared):
        h = self.n(x)
        return x + self.b(F.gelu(self.a(h)) + 0.5 * F.gelu(shared(h)))


class SharedAcrossBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(H, H), nn.Linear(H, H)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, self.blocks[0].a)
        return self.out(x)


def test_a_second_branch_added_within_a_block_is_no_block_end():
    torch.manual_seed(0)
    model = SharedAcrossBlocks()
    gm, d = planned(model, x_batch(), 2)
    assert set(d.column) == {"blocks.0.a.weight", "blocks.1.a.weight"}, d.report
    assert set(d.row) == {"blocks.0.b.weight", "blocks.1.b.weight"}, d.report
    assert_tp_matches(model, x_batch(), 2, d, gm)
