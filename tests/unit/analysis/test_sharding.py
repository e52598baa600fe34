"""Sharding propagation (DESIGN §3) on small captured graphs.

Placements are DTensor's ``Replicate()`` and ``Shard(d)`` (of the global shape), a
``PerOutput`` of them for a multi-output op, or ``CONFLICT`` after a conflict. Each test gives the column/row weight sets, runs
``propagate`` and checks the placement facts of the nodes, the shape-constant rewrites and
the conflicts: Before (the graph), Expected (the facts).
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.frontend.capture import capture
from parallelizer.analysis.sharding.placements import CONFLICT, REPLICATE, PerOutput, Shard
from parallelizer.analysis.sharding.propagate import propagate

aten = torch.ops.aten
H, HEADS, HD = 32, 4, 8


def graph_of(module: nn.Module, *shapes) -> torch.fx.Graph:
    torch.manual_seed(0)
    return capture(module, tuple(torch.randn(*s) for s in shapes), Path(__file__)).gm.graph


def nodes(graph, target) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def placement(prop, node):
    return prop.placements[node.name]


def inner(prop) -> list:
    """The conflicts at the graph's ops. These graphs return a column linear's shard on
    purpose; the output node's own conflict (the model returns it sharded: gathered by the
    next run) is tested in tests/unit/planning/test_tp_sharded_output.py."""
    return [c for c in prop.conflicts if c[0] != "output"]


class Moves(nn.Module):
    """A column linear's output (B, T, H), Shard(2), through ops that move the shard dim."""

    def __init__(self):
        super().__init__()
        self.col = nn.Linear(H, H, bias=False)

    def forward(self, x):
        y = self.col(x)
        return (
            y.transpose(1, 2),       # (B, H, T): Shard(1)
            y.transpose(0, 1),       # (T, B, H): Shard(2), untouched
            y.permute(2, 0, 1),      # (H, B, T): Shard(0)
            y.permute(1, 2, 0),      # (T, H, B): Shard(1)
            y.unsqueeze(0),          # (1, B, T, H): Shard(3)
            y.unsqueeze(-1),         # (B, T, H, 1): Shard(2)
            y.unsqueeze(2),          # (B, T, 1, H): Shard(3)
            F.gelu(y) * 2.0,         # elementwise: Shard(2)
            y.to(torch.float64),     # Shard(2)
            y.mean(1),               # reduce another dim: (B, H) Shard(1)
            y.sum(0, keepdim=True),  # keepdim: Shard(2)
            y.softmax(1),            # softmax over another dim: Shard(2)
            y.select(1, 0),          # (B, H): Shard(1)
        )


@pytest.fixture(scope="module")
def moves():
    graph = graph_of(Moves(), (2, 5, H))
    return graph, propagate(graph, {"col.weight"}, set(), tp=2)


@pytest.mark.parametrize("target, index, expected", [
    (aten.linear.default, 0, 2),
    (aten.transpose.int, 0, 1),
    (aten.transpose.int, 1, 2),
    (aten.permute.default, 0, 0),
    (aten.permute.default, 1, 1),
    (aten.unsqueeze.default, 0, 3),
    (aten.unsqueeze.default, 1, 2),
    (aten.unsqueeze.default, 2, 3),
    (aten.gelu.default, 0, 2),
    (aten.mul.Tensor, 0, 2),
    (aten.mean.dim, 0, 1),
    (aten.sum.dim_IntList, 0, 2),
    (aten.select.int, 0, 1),
])
def test_shard_dim_moves_with_the_op(moves, target, index, expected):
    graph, prop = moves
    assert placement(prop, nodes(graph, target)[index]) == Shard(expected)
    assert inner(prop) == []


def test_softmax_and_casts_keep_the_shard(moves):
    graph, prop = moves
    softmax = [n for n in graph.nodes if n.op == "call_function" and "softmax" in str(n.target)]
    assert [placement(prop, n) for n in softmax] == [Shard(2)]
    cast = [n for n in graph.nodes if n.op == "call_function"
            and n.target in (aten.to.dtype, aten._to_copy.default)]
    assert cast and all(placement(prop, n) == Shard(2) for n in cast)


def test_weights_are_seeded_column_shard0_row_shard1():
    graph = graph_of(MLP(), (2, 5, H))
    prop = propagate(graph, {"fc1.weight"}, {"fc2.weight"}, tp=2)
    attrs = {n.target: placement(prop, n) for n in graph.nodes if n.op == "get_attr"}
    assert attrs == {"fc1.weight": Shard(0), "fc1.bias": REPLICATE, "fc2.weight": Shard(1),
                     "fc2.bias": REPLICATE}
    fc1, fc2 = nodes(graph, aten.linear.default)
    assert placement(prop, fc1) == Shard(2)               # Shard(-1)
    assert placement(prop, nodes(graph, aten.gelu.default)[0]) == Shard(2)
    assert placement(prop, fc2) == REPLICATE              # Partial, resolved by g at once
    assert inner(prop) == [] and prop.rewrites == {}
    sizes = {(c.size, c.what, c.detail) for c in prop.constraints}
    assert sizes == {(4 * H, "features", "out_features of fc1.weight"),
                     (4 * H, "features", "in_features of fc2.weight")}
    assert all(c.module in ("fc1", "fc2") for c in prop.constraints)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Heads(nn.Module):
    """Split hidden into (heads, head_dim), attention over heads, merge back."""

    def __init__(self, minus_one: bool = False):
        super().__init__()
        self.minus_one = minus_one
        self.q = nn.Linear(H, H, bias=False)
        self.k = nn.Linear(H, H, bias=False)
        self.v = nn.Linear(H, H, bias=False)
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        heads = -1 if self.minus_one else HEADS

        def split(t):
            return t.view(B, T, heads, HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("tp", [2, 4])
def test_view_split_puts_shard_on_heads_and_divides_the_constant(tp):
    graph = graph_of(Heads(), (2, 5, H))
    prop = propagate(graph, {"q.weight", "k.weight", "v.weight"}, {"o.weight"}, tp=tp)
    assert inner(prop) == []
    views = nodes(graph, aten.view.default)
    assert len(views) == 3
    for view in views:
        assert placement(prop, view) == Shard(2)                         # (B, T, heads, hd): Shard(2)
        assert prop.rewrites[view.name] == [(1, 2, HEADS // tp)]  # args[1][2]: heads / tp
    assert [placement(prop, n) for n in nodes(graph, aten.transpose.int)] == [
        Shard(1), Shard(1), Shard(1), Shard(2)]
    sdpa = nodes(graph, aten.scaled_dot_product_attention.default)[0]
    assert placement(prop, sdpa) == Shard(1)                             # attention stays per head
    merge = nodes(graph, aten.reshape.default)[0]                 # (B, T, H): merged, Shard(2)
    assert placement(prop, merge) == Shard(2)
    assert prop.rewrites[merge.name] == [(1, 2, H // tp)]
    assert placement(prop, nodes(graph, aten.linear.default)[-1]) == REPLICATE
    heads = [c for c in prop.constraints if c.what == "heads" and c.size == HEADS]
    assert len(heads) == 3 and "dim 2 of the view to [*, *, 4, 8]" in heads[0].detail


def test_view_with_minus_one_heads_keeps_the_shard_without_a_rewrite():
    graph = graph_of(Heads(minus_one=True), (2, 5, H))
    prop = propagate(graph, {"q.weight", "k.weight", "v.weight"}, {"o.weight"}, tp=2)
    assert inner(prop) == []
    views = nodes(graph, aten.view.default)
    assert [placement(prop, v) for v in views] == [Shard(2)] * 3
    assert not any(v.name in prop.rewrites for v in views)        # -1 adapts by itself


class ReduceHidden(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.col = nn.Linear(H, H, bias=False)
        self.row = nn.Linear(H, H, bias=False)

    def forward(self, x):
        y = self.col(x)
        return self.row(y) + self.op(y)


@pytest.mark.parametrize("op, target", [
    (lambda y: y.sum(-1, keepdim=True), aten.sum.dim_IntList),
    (lambda y: y.mean(-1, keepdim=True), aten.mean.dim),
    (lambda y: y.amax(-1, keepdim=True), aten.amax.default),
    (lambda y: y.softmax(-1), "softmax"),
], ids=["sum", "mean", "amax", "softmax"])
def test_reduction_over_the_sharded_dim_is_a_conflict(op, target):
    graph = graph_of(ReduceHidden(op), (2, 5, H))
    prop = propagate(graph, {"col.weight"}, {"row.weight"}, tp=2)
    bad = [n for n in graph.nodes if n.op == "call_function"
           and (n.target is target or (isinstance(target, str) and target in str(n.target)))]
    assert len(bad) == 1 and placement(prop, bad[0]) == CONFLICT
    assert len(inner(prop)) == 1
    name, module, groups, reason = inner(prop)[0]
    assert name == bad[0].name and module == "" and groups == frozenset({"col.weight"})
    assert "cannot take a sharded input" in reason
    # everything downstream of the conflict is invalid, not silently replicated
    add = nodes(graph, aten.add.Tensor)[0]
    assert placement(prop, add) == CONFLICT


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.col = nn.Linear(H, H, bias=False)
        self.col2 = nn.Linear(H, H, bias=False)
        self.row = nn.Linear(H, H, bias=False)
        self.scale = nn.Parameter(torch.ones(H))
        self.gate = nn.Parameter(torch.ones(1))

    def forward(self, x):
        y = self.col(x)
        return self.row(y * self.gate), self.col2(y), x + y * self.scale


def test_linear_and_broadcast_conflicts():
    graph = graph_of(Residual(), (2, 5, H))
    prop = propagate(graph, {"col.weight", "col2.weight"}, {"row.weight"}, tp=2)
    by_node = {c[0]: c[3] for c in inner(prop)}
    by_weight = {n.args[1].target: n for n in nodes(graph, aten.linear.default)}
    col2, row = by_weight["col2.weight"], by_weight["row.weight"]
    muls = nodes(graph, aten.mul.Tensor)
    # a size-1 replicated operand broadcasts along the shard: fine
    assert placement(prop, muls[0]) == Shard(2) and placement(prop, row) == REPLICATE
    # a column_parallel linear fed a sharded input
    assert by_node[col2.name] == "column_parallel linear needs a replicated input"
    # a full-size replicated operand along the sharded dim (an RMSNorm weight, say)
    assert "cannot take a sharded input" in by_node[muls[1].name]


def test_row_linear_needs_shard_minus_one():
    graph = graph_of(MLP(), (2, 5, H))
    prop = propagate(graph, set(), {"fc2.weight"}, tp=2)
    assert [c[3] for c in inner(prop)] == ["row_parallel linear needs Shard(-1) input"]
    assert inner(prop)[0][1] == "fc2"


class _Between(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.col = nn.Linear(H, H, bias=False)
        self.row = nn.Linear(H, H, bias=False)

    def forward(self, x):
        return self.row(self.op(self.col(x)))


@pytest.mark.parametrize("op, reason", [
    # DTensor's scan strategy would all-gather the sharded dim (dim -1 normalised to 2 first)
    (lambda h: torch.cumsum(h, dim=-1), "aten.cumsum.default cannot take a sharded input "
                                        "here (DTensor's strategy would redistribute it)"),
    # neither our table nor DTensor (torch 2.13) has a strategy for renorm
    (lambda h: torch.renorm(h, 2, 0, 1.0), "no sharding rule for aten.renorm.default (ours "
                                           "or DTensor's)"),
], ids=["cumsum-dtensor-redistributes", "renorm-no-rule"])
def test_op_without_rule_is_a_conflict_naming_the_op(op, reason):
    graph = graph_of(_Between(op), (2, 5, H))
    prop = propagate(graph, {"col.weight"}, {"row.weight"}, tp=2)
    assert [c[3] for c in inner(prop)] == [reason]


def test_dtensor_strategy_keeps_a_shard_our_table_has_no_rule_for():
    """cumsum over the sequence: DTensor's scan strategy takes Shard(2) as it is."""
    graph = graph_of(_Between(lambda h: torch.cumsum(h, dim=1)), (2, 5, H))
    prop = propagate(graph, {"col.weight"}, {"row.weight"}, tp=2)
    assert inner(prop) == []
    cumsum = next(n for n in graph.nodes if n.target is torch.ops.aten.cumsum.default)
    assert prop.placements[cumsum.name] == Shard(2)


class MaxOverHidden(nn.Module):
    """``h.max(-1)`` returns (values, indices): a tuple-valued node."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(F.gelu(h)) + h.max(dim=-1, keepdim=True).values


def test_multi_output_op_on_sharded_input_is_a_conflict():
    graph = graph_of(MaxOverHidden(), (2, 5, H))
    prop = propagate(graph, {"fc1.weight"}, {"fc2.weight"}, tp=2)
    max_dim = nodes(graph, aten.max.dim)[0]
    assert placement(prop, max_dim) == CONFLICT
    assert any(c[0] == max_dim.name for c in inner(prop))


def test_split_and_cat_follow_the_shard():
    class SplitCat(nn.Module):
        def __init__(self):
            super().__init__()
            self.col = nn.Linear(H, H, bias=False)

        def forward(self, x):
            y = self.col(x).view(x.shape[0], x.shape[1], HEADS, HD)  # Shard(2)
            a, b = y.split(HD // 2, dim=-1)                          # split another dim
            rotated = torch.cat([-b, a], dim=-1)                     # cat another dim
            c, d = y.chunk(2, dim=2)                                 # split the sharded dim
            return rotated, c

    graph = graph_of(SplitCat(), (2, 5, H))
    prop = propagate(graph, {"col.weight"}, set(), tp=2)
    cat = nodes(graph, aten.cat.default)[0]
    assert placement(prop, cat) == Shard(2)
    splits = [n for n in graph.nodes if n.op == "call_function"
              and n.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)]
    assert placement(prop, splits[0]) == PerOutput((Shard(2), Shard(2)))
    assert placement(prop, splits[1]) == CONFLICT
    assert len(inner(prop)) == 1 and inner(prop)[0][0] == splits[1].name


class Pieces(nn.Module):
    """A column weight (48, H) read in pieces by two linears on two inputs, the second
    piece unflattened into two parts (torch's cross-attention in_proj, its ``split([E, 2E])``
    spelled three ways), and a row linear after both."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(48, H))
        self.out = nn.Linear(16, H)

    def forward(self, x, y):
        if self.how == "split":
            wq, wkv = self.w.split([16, 32])
        elif self.how == "slice":
            wq, wkv = self.w[:16], self.w[16:]
        else:
            wq, wkv = self.w.narrow(0, 0, 16), self.w.narrow(0, 16, 32)
        k, v = F.linear(y, wkv).unflatten(-1, (2, 16)).unbind(-2)
        return self.out(F.linear(x, wq) * k.sigmoid() + v)


@pytest.mark.parametrize("how", ["split", "slice", "narrow"])
def test_a_weight_read_in_pieces_is_fused_with_local_piece_sizes(how):
    from parallelizer.plan.layouts import Fused
    g = graph_of(Pieces(how), (2, 5, H), (2, 5, H))
    prop = propagate(g, {"w"}, {"out.weight"}, 2)
    prop = propagate(g, {"w"}, {"out.weight"}, 2, prop.found_layouts())
    assert prop.found_layouts()["w"] == Fused((16, 16, 16))
    assert prop.found_layouts()["w[16:48]"] == Fused((16, 16))
    assert not inner(prop) and not prop.layout_conflicts()
    cut = {aten.split_with_sizes.default: [(1, 0, 8), (1, 1, 16)],
           aten.slice.Tensor: [(3, None, 8)], aten.narrow.default: [(2, None, 0), (3, None, 8)]}
    target = {"split": aten.split_with_sizes.default, "slice": aten.slice.Tensor,
              "narrow": aten.narrow.default}[how]
    first = nodes(g, target)[0]
    assert prop.rewrites[first.name] == cut[target]
    for lin in nodes(g, aten.linear.default)[:2]:
        assert placement(prop, lin) == Shard(2)


class ChunkedBias(nn.Module):
    """q/k/v weights of their own and one bias read as ``b.chunk(3)`` (torch's kdim/vdim),
    or one weight read as ``w.chunk(3)``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.randn(16, H)) for _ in range(3))
        self.b = nn.Parameter(torch.randn(48))
        self.w = nn.Parameter(torch.randn(48, H))
        self.out = nn.Linear(16, H)

    def forward(self, x):
        bq, bk, bv = self.b.chunk(3)
        wq, wk, wv = self.w.chunk(3)
        a = F.linear(x, self.q, bq) * F.linear(x, self.k, bk).sigmoid() + F.linear(x, self.v, bv)
        return self.out(a) + self.out(F.linear(x, wq) + F.linear(x, wk) * F.linear(x, wv))


def test_a_bias_shared_with_a_replicated_linear_is_a_conflict():
    from parallelizer.plan.layouts import Fused
    g = graph_of(ChunkedBias(), (2, 5, H))
    prop = propagate(g, {"q", "k", "v", "w"}, {"out.weight"}, 2)
    assert not inner(prop) and prop.found_layouts()["b"] == Fused((16, 16, 16))
    prop = propagate(g, {"q", "k", "w"}, {"out.weight"}, 2)
    reasons = [c for c in inner(prop) if "its bias b is shared" in c[3]]
    assert reasons and reasons[0][2] == frozenset({"q", "k"})
    assert "the replicated linear v" in reasons[0][3]


def test_a_chunk_into_unequal_local_pieces_is_a_conflict():
    from parallelizer.plan.layouts import Fused, ReplicatedHeads
    g = graph_of(ChunkedBias(), (2, 5, H))
    even = propagate(g, {"w", "q", "k", "v"}, {"out.weight"}, 2)
    assert even.found_layouts()["w"] == Fused((16, 16, 16)) and not inner(even)
    # a piece of copied heads (one head of 16 on both ranks): 8, 16, 8 local rows
    copied = Fused((16, 16, 16), (None, ReplicatedHeads(1, 16), None))
    prop = propagate(g, {"w", "q", "k", "v"}, {"out.weight"}, 2, {"w": copied})
    chunk = nodes(g, aten.chunk.default)[1]
    assert placement(prop, chunk) == CONFLICT
    assert any(c[0] == chunk.name and "[8, 16, 8] elements on each rank" in c[3]
               for c in inner(prop))
