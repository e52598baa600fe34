"""Four ways a held-out model lost sharded matrices, found by a break test (issue 23;
decision 81):

- the seed walk followed a tensor's size queries. In a graph transformer (Graphormer/GPS
  style: global attention beside message passing) ``B, N, D = h.shape`` sizes each head
  merge view by the stream, so the walk from the node encoder reached every block's
  output projection and message MLP through ``sym_size`` and paired them with it; the
  message branch's conflict then took that whole group, block 0's attention included;
- the message branch itself: no rule took a gather of rows ``m[src]`` (its size known only
  at run time) or ``index_add_`` over feature-sharded rows; both keep the feature shard
  (``analysis/sharding/cuts.index_rule``, ``rules._index_add``);
- the attention bias ``edge_bias * adj``, of the scores' full shape, was taken for the
  residual stream, ending the walk from q and k (``residual_stream._stream``): without an MLP in
  the layers, q and k stayed replicated;
- a conflict kept its whole pair component whole, and the redistributions asked for the
  linears it dropped stayed: multi-query attention with one fused k|v head ended with
  every block's q, k, v and o replicated, or with q sharded and gathered again. Only the
  conflicting linears and those left without a partner are dropped now, and the
  redistributions are asked anew: q head-sharded, the one kv head copied to every rank
  (``replicated_heads``, decision 108), o row-parallel, no redistribution (Shazeer 2019, "Fast Transformer
  Decoding: One Write-Head is All You Need").

Each rank equals the model: outputs, every gradient, one SGD step (fp32, 1e-5)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.plan.layouts import ReplicatedHeads

from tp_check import plan_and_check

D, HEADS = 32, 4


class GPSLayer(nn.Module):
    """Global attention with a learned per-head edge bias beside GIN-style message passing
    (``index_add_`` over the edge list), then an MLP, as a user wrote it (Rampasek et al.
    2022, GPS)."""

    def __init__(self, mlp=True):
        super().__init__()
        self.mlp = mlp
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.edge_bias = nn.Parameter(torch.zeros(HEADS, 1, 1))
        self.msg, self.mix = nn.Linear(D, D), nn.Linear(D, D)
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        if mlp:
            self.n3, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h, adj):
        B, N, _ = h.shape
        x = self.n1(h)
        q, k, v = (m(x).view(B, N, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS) + self.edge_bias * adj.unsqueeze(1)
        g = self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))
        m = F.relu(self.msg(self.n2(h))).reshape(B * N, D)
        b, i, j = (adj > 0).nonzero(as_tuple=True)
        agg = torch.zeros_like(m).index_add_(0, b * N + i, m[b * N + j])
        h = h + g + self.mix(m + agg).reshape(B, N, D)
        return h + self.fc2(F.gelu(self.fc1(self.n3(h)))) if self.mlp else h


class GraphTransformer(nn.Module):
    def __init__(self, mlp=True):
        super().__init__()
        self.encoder = nn.Linear(8, D)
        self.layers = nn.ModuleList(GPSLayer(mlp) for _ in range(2))
        self.readout = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 1)) if mlp else nn.Linear(D, 1)

    def forward(self, feats, adj, y):
        h = self.encoder(feats)
        for layer in self.layers:
            h = layer(h, adj)
        return self.readout(h.mean(1)).squeeze(-1) - y


def graph_batch():
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(4, 12, 12, generator=g) < 0.3).float()
    adj = ((a + a.transpose(1, 2)) > 0).float()
    return torch.randn(4, 12, 8, generator=g), adj, torch.randn(4, generator=g)


class MultiQuery(nn.Module):
    """One k|v head in one linear, broadcast against the query heads by matmul."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * (D // HEADS)), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HEADS, -1).transpose(1, 2)
        k, v = self.kv(x).unsqueeze(1).split(D // HEADS, dim=-1)
        s = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
        y = (s + torch.full((T, T), float("-inf")).triu(1)).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class MQANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleList(MultiQuery() for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        for norm, attn in zip(self.norms, self.attn):
            x = x + attn(norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("tp,mlp", [(2, True), (4, True), (2, False)])
def test_graph_transformer_attention_sharded_in_every_layer(tp, mlp):
    torch.manual_seed(0)
    d = plan_and_check(GraphTransformer(mlp), graph_batch(), tp)
    for i in range(2):
        assert {f"layers.{i}.{m}.weight" for m in "qkv"} <= d.column, sorted(d.column)
        assert f"layers.{i}.o.weight" in d.row, sorted(d.row)
        assert not mlp or f"layers.{i}.fc2.weight" in d.row, sorted(d.row)
        # the message branch: rows gathered by index, summed by index_add_ into zeros, per
        # rank on its block of features
        assert f"layers.{i}.msg.weight" in d.column and f"layers.{i}.mix.weight" in d.row
    assert "encoder.weight" not in d.column | d.row


def test_multi_query_attention_copies_its_one_kv_head():
    torch.manual_seed(0)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2))
    d = plan_and_check(MQANet(), (x,), 2)
    for i in range(2):
        assert f"attn.{i}.q.weight" in d.column and f"attn.{i}.o.weight" in d.row
        # the one kv head is copied to every rank (decision 108; it was kept whole with an
        # f before each read), the matmul broadcasting it against the rank's query heads
        assert d.layouts[f"attn.{i}.kv.weight"] == ReplicatedHeads(1, 2 * (D // HEADS))
    assert not [r for r in d.report if r.startswith("redistribution")], d.report
    assert not [r for r in d.report if r.startswith("f (copy_to_tp_region)")], d.report
