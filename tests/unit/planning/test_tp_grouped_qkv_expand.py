"""litgpt's CausalSelfAttention: one fused ``attn`` projection viewed as (B, T, groups,
q_per_kv + 2, head_size), split into q, k, v per query group, k and v ``.expand``-ed to the
group's query heads and reshaped to (B, heads, T, head_size).

At tp 4 with 2 query groups no rank can hold a whole group. The plan that keeps ``attn``
whole (tp_candidates.py _whole_kv, as for a fused q|k|v sliced by sizes) was never tried:
the expand's heads constraint named no origin weight, so _whole_kv gave up and the compile
was refused ("mesh.tp (4) must divide the number of heads (2)") although the MLP and the
output projection shard. Now the expand's constraint carries the column weights behind it,
``attn`` is kept whole (reported) and the rest is sharded. tp 2 shards ``attn`` by groups
as before. Each rank equals the unmodified model (outputs, every gradient, one SGD step;
fp32, 1e-5).
"""
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp

from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch

HEADS, GROUPS, D = 4, 2, 8


class GroupedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(H, (HEADS + 2 * GROUPS) * D, bias=False)
        self.proj = nn.Linear(HEADS * D, H, bias=False)
        self.fc = nn.Linear(H, 64, bias=False)
        self.out = nn.Linear(64, H, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q_per_kv = HEADS // GROUPS
        qkv = self.attn(x).view(B, T, GROUPS, q_per_kv + 2, D).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, GROUPS, q_per_kv, T, D)
        v = v.expand(B, GROUPS, q_per_kv, T, D)
        q, k, v = (t.reshape(B, -1, T, D) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, HEADS * D))
        return x + self.out(F.silu(self.fc(x)))


def _planned(tp):
    torch.manual_seed(0)
    model = GroupedQKV()
    cap = captured(model, x_batch())
    decision = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, decision)
    return model, cap.gm, decision


def test_groups_fewer_than_tp_keep_the_fused_projection_whole():
    model, gm, d = _planned(4)
    assert "attn.weight" not in d.column
    assert {"fc.weight"} <= d.column and {"proj.weight", "out.weight"} <= d.row
    assert any(line.startswith("kept whole: attn.weight") for line in d.report), d.report
    assert_tp_matches(model, x_batch(), 4, d, gm)


def test_tp_dividing_the_groups_shards_the_fused_projection():
    model, gm, d = _planned(2)
    assert {"attn.weight", "fc.weight"} <= d.column and {"proj.weight", "out.weight"} <= d.row
    assert not d.redistributions
    assert_tp_matches(model, x_batch(), 2, d, gm)
