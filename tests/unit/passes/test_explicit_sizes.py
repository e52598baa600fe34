"""explicit_sizes pass (passes/explicit_sizes.py): ``view_as`` / ``reshape_as`` /
``expand_as`` spelled as sizes, so tensor parallelism divides the sharded one. The model of
issue 23 that casts its weights in forward viewed the head-sharded attention output as its
replicated input (``y.view_as(x)``) and failed on every rank's shapes at compile time."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.analysis.graph_facts import aten
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.explicit_sizes import apply_explicit_sizes
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch


class ViewAsAttention(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.heads, self.hd = heads, H // heads
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.hd).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view_as(x)
        return x + self.o(y) + torch.ones(1).expand_as(x)


def test_as_ops_become_explicit_sizes_with_the_dynamic_dims_read_from_the_tensor():
    gm = captured(ViewAsAttention(), x_batch()).gm
    before = copy.deepcopy(gm)
    assert apply_explicit_sizes(gm)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.view_as.default not in targets and aten.expand_as.default not in targets
    views = [n for n in gm.graph.nodes if n.target is aten.view.default and len(n.args[1]) == 3]
    assert any(n.args[1][-1] == H and isinstance(n.args[1][0], torch.fx.Node) for n in views)
    x = x_batch(3, 7, seed=1)  # other sizes than captured: the dynamic dims are read
    torch.testing.assert_close(gm(*x), before(*x), rtol=0, atol=0)


def test_view_as_of_head_sharded_attention_shards_and_matches_at_tp2():
    torch.manual_seed(0)
    model = ViewAsAttention()
    batch = x_batch()
    gm = captured(model, batch).gm
    apply_explicit_sizes(gm)
    d = plan_tp(gm.graph, 2)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    assert not d.redistributions
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    assert_tp_matches(model, batch, 2, d, gm)
