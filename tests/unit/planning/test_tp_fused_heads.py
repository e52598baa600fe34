"""Attention written as Falcon and BLOOM write it, on small hand-written modules: a fused
q|k|v whose heads view is cut by a slice and constant indices (one kv head copied to every
rank), and heads merged into the batch dim for batched matmuls (a strided shard). Each
either shards (with redistributions where a rule is missing) and equals the unmodified
model (outputs, gradients, one SGD step; fp32, 1e-5) or stays replicated with the op that
stopped it in the report, never mis-sharded."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.layouts import Fused, ReplicatedHeads
from parallelizer.planning.tp import plan_tp

from tp_check import assert_tp_matches

H, HEADS, D = 32, 4, 8


class MultiQuery(nn.Module):
    """q heads | one k head | one v head in one linear, cut out of a (heads + 2) view by a
    slice and indices (Falcon up to transformers 5.24; ``k_at``, ``v_at``: the indices) or by
    ``split([heads, 1, 1])`` along the heads (Falcon from 5.25; ``k_at`` None)."""

    def __init__(self, k_at, v_at):
        super().__init__()
        self.qkv = nn.Linear(H, H + 2 * D)
        self.o = nn.Linear(H, H)
        self.k_at, self.v_at = k_at, v_at

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, HEADS + 2, D)
        if self.k_at is None:
            q, k, v = qkv.split([HEADS, 1, 1], dim=-2)
        else:
            q, k, v = qkv[:, :, :-2], qkv[:, :, [self.k_at]], qkv[:, :, [self.v_at]]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


class MergedHeads(nn.Module):
    """Scores by bmm over (batch * heads), with a per-head slope bias tiled over the batch
    (ALiBi-like); ``heads_outer`` merges (heads, batch) instead, which has no strided rule."""

    def __init__(self, heads_outer=False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(H, H) for _ in range(3))
        self.o = nn.Linear(H, H)
        self.heads_outer = heads_outer

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.heads_outer:
            q, k, v = (a.transpose(0, 1) for a in (q, k, v))
        q, k, v = (a.reshape(b * HEADS, t, D) for a in (q, k, v))
        slopes = 0.5 ** torch.arange(1, HEADS + 1, dtype=torch.float32)
        bias = (slopes[:, None, None] * torch.arange(t)).repeat(b, 1, 1)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=D ** -0.5)
        y = torch.bmm(scores.softmax(-1), v)
        y = y.view(HEADS, b, t, D).transpose(0, 1) if self.heads_outer else y.view(b, HEADS, t, D)
        return x + self.o(y.transpose(1, 2).reshape(b, t, H))


def _batch(b=2, t=5, seed=0):
    return (torch.randn(b, t, H, generator=torch.Generator().manual_seed(seed)),)


def _plan(model, tp):
    torch.manual_seed(0)
    cap = capture(model, _batch(), Path(__file__))
    return cap, plan_tp(cap.gm.graph, tp)


def _matches(model, cap, d, tp):
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    assert_tp_matches(model, _batch(3, 7, seed=1), tp, d, cap.gm)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("cut", ["index", "split"])
def test_one_kv_head_cut_from_a_fused_qkv_is_copied_and_matches(tp, cut):
    """Either cut gives the same fused layout, no redistribution: at tp2 the 6 heads of the
    view would split evenly, but then rank 0 would hold q heads and rank 1 q, k and v."""
    torch.manual_seed(0)
    model = MultiQuery(-2, -1) if cut == "index" else MultiQuery(None, None)
    cap, d = _plan(model, tp)
    assert {"qkv.weight", "o.weight"} <= d.column | d.row
    rh = ReplicatedHeads(1, D)
    assert d.layouts["qkv.weight"] == Fused((H, D, D), (None, rh, rh))
    assert not d.redistributions
    _matches(model, cap, d, tp)


def test_positive_kv_index_that_would_need_a_rewrite_stays_replicated():
    """qkv[:, :, [4]] picks the k head globally; on a rank's piece (2 q heads | k | v) the
    k head is at 2, and index constants are not rewritten: kept replicated, reported."""
    torch.manual_seed(0)
    with pytest.raises(PlanError, match=r"no weight matrix could be sharded; the first op that "
                                        r"stopped it: aten\.index\.Tensor at test_tp_fused_heads"):
        _plan(MultiQuery(HEADS, HEADS + 1), 2)


def test_heads_merged_into_batch_shard_strided_with_slopes_cut_to_the_rank(tp=2):
    torch.manual_seed(0)
    model = MergedHeads()
    cap, d = _plan(model, tp)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    assert len(d.narrows) == 1 and any("cut to each rank's heads" in r for r in d.report)
    _matches(model, cap, d, tp)


def test_heads_merged_outside_the_batch_are_gathered_before_the_slopes():
    """(heads, batch) -> heads * batch is the even split of the merged dim, but the slopes
    are tiled batch-major (b * H + h): no rank holds matching rows, so the merged scores
    are all-gathered (a redistribution) and the attention between q|k|v and o runs whole;
    the projections stay sharded and the ranks equal the unmodified model."""
    torch.manual_seed(0)
    model = MergedHeads(heads_outer=True)
    cap, d = _plan(model, 2)
    assert d.column == {"q.weight", "k.weight", "v.weight"} and d.row == {"o.weight"}
    assert any(r.kind == "all_gather" and "baddbmm" in r.why for r in d.redistributions)
    _matches(model, cap, d, 2)

class PartsBeforeMergedHeads(nn.Module):
    """segment-anything's ViT attention: the fused q|k|v viewed (B, N, 3, heads, hd),
    permuted to (3, B, heads, N, hd) and reshaped to (3, B * heads, N, hd) before it is
    unbound. The parts were taken one by one only through permutes and copies, so the view
    read as heads, and the 3 parts as the heads tp divides: "tp = 2 does not divide the 3
    heads", the attention kept whole (zoo 16 Z2)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * HEADS, n, -1).unbind(0)
        attn = ((q * D ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
        y = (attn @ v).view(b, HEADS, n, -1).permute(0, 2, 1, 3).reshape(b, n, -1)
        return x + self.proj(y)


@pytest.mark.parametrize("tp", [2, 4])
def test_parts_taken_after_a_view_merging_batch_and_heads_are_fused_parts(tp):
    torch.manual_seed(0)
    model = PartsBeforeMergedHeads()
    cap, d = _plan(model, tp)
    assert d.column == {"qkv.weight"} and d.row == {"proj.weight"}
    assert d.layouts["qkv.weight"] == Fused((H, H, H)) and not d.redistributions
    _matches(model, cap, d, tp)


class BucketBiasMergedHeads(nn.Module):
    """torchscale's RelativePositionBias: a (buckets, heads) table looked up by each
    (query, key) bucket, ``permute(2, 0, 1).unsqueeze(0).repeat(B, 1, 1, 1).view(-1, q, k)``
    once for the model, then ``rel.view(scores.size())`` added to each block's (batch *
    heads) scores. The add read as the residual stream (its operand an embedding's output),
    so the walks from q and k ended there, and the bias, a same-shape view of a merge, was
    not cut to the rank's heads: DeepNet with relative positions kept its attention whole (4
    of 12 matrices, zoo 16)."""

    def __init__(self, buckets=8):
        super().__init__()
        self.buckets = buckets
        self.emb, self.table = nn.Embedding(50, H), nn.Embedding(buckets, HEADS)
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(H, H) for _ in range(4))
                                    for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        b, t, _ = x.shape
        pos = torch.arange(t)
        bucket = (pos[None, :] - pos[:, None]).clamp(-self.buckets // 2, self.buckets // 2 - 1)
        rel = self.table(bucket + self.buckets // 2).permute(2, 0, 1).unsqueeze(0)
        rel = rel.repeat(b, 1, 1, 1).view(-1, t, t)
        for q, k, v, o in self.blocks:
            q, k, v = (p(x).view(b, t, HEADS, D).transpose(1, 2).reshape(b * HEADS, t, D)
                       for p in (q, k, v))
            scores = torch.bmm(q, k.transpose(1, 2)) * D ** -0.5
            scores = scores + rel.view(scores.size())
            y = torch.bmm(scores.softmax(-1), v).view(b, HEADS, t, D).transpose(1, 2)
            x = x + o(y.reshape(b, t, H))
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_bucket_bias_repeated_over_the_batch_is_cut_to_the_rank(tp):
    torch.manual_seed(0)
    model = BucketBiasMergedHeads()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    cap = capture(model, (ids,), Path(__file__))
    d = plan_tp(cap.gm.graph, tp)
    assert d.column == {f"blocks.{i}.{j}.weight" for i in range(2) for j in range(3)}
    assert d.row == {"blocks.0.3.weight", "blocks.1.3.weight"}
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, d)
    other = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    assert_tp_matches(model, (other,), tp, d, cap.gm)
