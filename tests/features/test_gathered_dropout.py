"""Attention dropout where no sharded rule takes attention's inputs (issue 23): a multi-query
c_attn ``unsqueeze(1).split((E, D, D), dim=3)`` whose one-head k and v SDPA broadcasts over
the query heads itself (no repeat_kv, no enable_gqa: GPTBigCode's own forms are copied to
each rank instead, test_tp_fused_one_head.py) leaves k and v split along head_dim, so q, k
and v are all-gathered and SDPA runs whole on every tp rank. Its dropout
must then draw the same mask on every rank (the replicated stream), as any op whose inputs
were gathered to Replicate: with per-rank masks (the tp stream, which the query's
propagated placement alone suggested) rank r back-propagates every head through its own
mask, so the one k/v head's gradient sums heads whose forward used another rank's mask.
Seeded, each rank's outputs, gradients and SGD step then equal the unmodified model's
with dropout on (Megatron-LM's model-parallel RNG, Shoeybi et al. 2019 §3)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.dropout import apply_rng_streams
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.dropout import plan_dropout
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime import rng
from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch

HEADS, D = 4, 8


class FusedMQA(nn.Module):
    """Multi-query attention as GPTBigCode fuses it: one c_attn for q (4 heads) | k | v (one
    head each), split along a dim the heads view never names; SDPA with dropout."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = p
        self.c_attn, self.c_proj = nn.Linear(H, H + 2 * D), nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).unsqueeze(1).split((H, D, D), dim=3)
        q = q.view(b, t, HEADS, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        return x + self.c_proj(y.transpose(1, 2).reshape(b, t, H))


@pytest.fixture(autouse=True)
def _fresh_streams():
    yield
    rng._seeds.clear()
    rng._generators.clear()


def test_dropout_of_attention_computed_whole_draws_one_mask_and_matches():
    model, batch = FusedMQA(), x_batch(3, 6, seed=1)
    gm = captured(model, batch).gm
    decision = plan_tp(gm.graph, 2)
    gathered = {r.readers[0] for r in decision.redistributions if r.kind == "all_gather"}
    sdpa = [n.name for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and set(sdpa) <= gathered, (sdpa, decision.redistributions)
    sites = plan_dropout(gm.graph, decision.placements, decision.redistributions)
    assert [(s.op, s.stream) for s in sites] == [
        ("aten.scaled_dot_product_attention.default", "replicated")]
    apply_cleanup(gm)
    apply_tensor_parallel(gm, decision)
    apply_rng_streams(gm, sites)
    (out,) = assert_tp_matches(model, batch, 2, decision, gm, seed=5)
    torch.manual_seed(6)  # the masks were drawn: another seed, another output
    assert not torch.allclose(model(*batch), out)
