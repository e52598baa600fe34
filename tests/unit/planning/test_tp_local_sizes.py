"""Size constants of a sharded dim become each rank's local sizes in every op that spells
them, not only in the views our rules know: ops DTensor answers (``new_ones`` and the other
``new_*`` factories, whose shape DTensor itself rewrites to local), and ``broadcast_to``
(torch.export keeps it apart from ``expand``, which it is defined as; Falcon-40B's grouped
attention broadcasts each group's k and v head with it). Each shards and equals the
unmodified model (outputs, gradients, one SGD step; fp32, 1e-5)."""
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp

from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch

HEADS, D = 4, 8


class NewOnes(nn.Module):
    """A column output plus a ``new_ones`` of its global shape, then the row linear."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        h = self.a(x)
        return self.b(F.gelu(h + h.new_ones((x.shape[0], x.shape[1], 2 * H))))


class GroupedAttention(nn.Module):
    """Falcon-40B's layout: one qkv viewed as (groups, queries per group + 2, head_dim),
    each group's k and v head ``broadcast_to`` its queries."""

    def __init__(self, groups=2):
        super().__init__()
        self.groups = groups
        self.qkv = nn.Linear(H, H + 2 * groups * D)
        self.o = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        g = self.qkv(x).view(b, t, self.groups, HEADS // self.groups + 2, D)
        q = g[:, :, :, :-2]
        k = torch.broadcast_to(g[:, :, :, [-2]], q.shape)
        v = torch.broadcast_to(g[:, :, :, [-1]], q.shape)
        q, k, v = (a.flatten(2, 3).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


def _compiled(model, tp):
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    return cap, d


def _local_sizes(cap, op):
    return [list(n.args[1]) for n in cap.gm.graph.nodes if n.target is op]


def test_new_ones_of_a_sharded_shape_gets_the_local_shape():
    """DTensor places new_ones like its input and gives the local shape, written into the
    constant (2H -> H at tp2); it used to be dropped, and the rank's add failed on shapes."""
    torch.manual_seed(0)
    model = NewOnes()
    cap, d = _compiled(model, 2)
    assert d.column == {"a.weight"} and d.row == {"b.weight"} and not d.redistributions
    assert [s[-1] for s in _local_sizes(cap, torch.ops.aten.new_ones.default)] == [H]
    assert_tp_matches(model, x_batch(3, 7, seed=1), 2, d, cap.gm)


def test_broadcast_to_is_expand_and_gets_the_local_groups():
    """(B, T, groups, 1, D) broadcast_to (B, T, groups, 2, D) with the groups sharded at tp2:
    the groups constant becomes 1, each rank computes its group's attention."""
    torch.manual_seed(0)
    model = GroupedAttention()
    cap, d = _compiled(model, 2)
    assert {"qkv.weight", "o.weight"} <= d.column | d.row and not d.redistributions
    assert not any(n.target is torch.ops.aten.broadcast_to.default for n in cap.gm.graph.nodes)
    assert [s[2] for s in _local_sizes(cap, torch.ops.aten.expand.default)
            if len(s) == 5] == [1, 1]
    assert_tp_matches(model, x_batch(3, 7, seed=1), 2, d, cap.gm)
