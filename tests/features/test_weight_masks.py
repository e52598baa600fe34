"""A weight multiplied by a mask buffer at its own shape before the product: torch's pruning
API (``torch.nn.utils.prune``: a forward pre-hook computes ``weight_mask.to(dtype) *
weight_orig``) and hand-written sparsity masks (``F.linear(h, w * self.mask)``). The
product read no parameter directly, so no linear was found and every pruned model was
refused at tp > 1 ("no linear layer feeds another"; zoo 20 Z5: a masked down projection
kept its MLP replicated). The mask is now part of the weight path
(analysis/linears.py ``mask_of``), cut as its weight is, fused layout included
(planning/tp.py ``TPDecision.masks``): each rank's product is its piece of the model's
(decision 213)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn

from parallelizer.errors import PlanError
from tp_check import plan_and_check
from tp_small_models import H, x_batch

HEADS = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, H))
        return x + self.down(F.gelu(self.up(x)))


class Pruned(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        for block in self.blocks:
            for name in ("qkv", "o", "up", "down"):
                prune.l1_unstructured(getattr(block, name), "weight", amount=0.4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def __deepcopy__(self, memo):
        # prune's computed ``weight`` attribute is no graph leaf, which deepcopy refuses;
        # the reference is the same model rebuilt from its state (weight_orig, weight_mask)
        twin = Pruned()
        twin.load_state_dict(self.state_dict())
        return twin


@pytest.mark.parametrize("tp", [2, 4])
def test_a_model_pruned_by_torch_is_sharded_with_its_masks(tp):
    torch.manual_seed(0)
    d = plan_and_check(Pruned(), x_batch(), tp)
    for i in range(2):
        p = f"blocks.{i}"
        assert {f"{p}.qkv.weight_orig", f"{p}.up.weight_orig"} <= d.column
        assert {f"{p}.o.weight_orig", f"{p}.down.weight_orig"} <= d.row
        for name in ("qkv", "o", "up", "down"):
            mask, w = f"{p}.{name}.weight_mask", f"{p}.{name}.weight_orig"
            assert d.masks[mask] == w and d.dims[mask] == d.dims[w]
            assert d.layouts.get(mask) == d.layouts.get(w)
        assert d.layouts[f"{p}.qkv.weight_mask"].text() == f"fused [{H}, {H}, {H}]"


class MaskedMLP(nn.Module):
    """The mask as the product's second operand, its weight read through ``.weight``."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        g = torch.Generator().manual_seed(3)
        self.register_buffer("mask", (torch.rand(H, 4 * H, generator=g) > 0.3).float())
        self.shared = shared

    def forward(self, x):
        h = F.gelu(self.up(x))
        y = x + F.linear(h, self.down.weight * self.mask, self.down.bias)
        return y + self.mask.sum() if self.shared else y


class Net(nn.Module):
    def __init__(self, shared: bool = False):
        super().__init__()
        self.mlps = nn.ModuleList(MaskedMLP(shared) for _ in range(2))

    def forward(self, x):
        for mlp in self.mlps:
            x = mlp(x)
        return x


def test_a_hand_written_mask_is_cut_with_its_row_parallel_weight():
    torch.manual_seed(0)
    d = plan_and_check(Net(), x_batch(), 2)
    for i in range(2):
        assert f"mlps.{i}.up.weight" in d.column and f"mlps.{i}.down.weight" in d.row
        assert d.dims[f"mlps.{i}.mask"] == 1


def test_a_mask_read_elsewhere_too_is_no_weight_path():
    """A mask some other op reads whole is no part of the weight path: the product is not a
    linear, and with no other pair the compile refuses as before, naming the weight, the op
    and the line."""
    torch.manual_seed(0)
    with pytest.raises(PlanError, match=r"mlps\.0\.down\.weight \(32x128, read by "
                                        r"aten\.mul\.Tensor at test_weight_masks\.py:\d+"):
        plan_and_check(Net(shared=True), x_batch(), 2)
