"""Multi-query attention (one kv head) and heads tp cannot divide, as users write them.

- The one kv head spread by a plain ``expand`` (no repeat_kv reshape): each rank's block of
  the expanded heads is copies of the head, so k/v are copied heads and attention runs on
  each rank's query heads with no redistribution. Main before: k, v split along head_dim,
  every q/k/v all-gathered and attention computed whole on every rank.
- One kv head normed over its whole projection before the view (OLMo-2 with
  ``num_key_value_heads=1``): split, k's shard lands on head_dim; k and v are kept whole and
  attention cuts each rank's copy. Main before: head_dim split and q gathered.
- A per-head op on heads tp does not divide: attention kept replicated, and the report names
  the heads as the cause, not only the op that met them.
Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from parallelizer.planning.tp_matrices import tp_summary

from tp_check import assert_tp_matches
from tp_small_models import H, captured, x_batch

HEADS, D = 4, 8


class ExpandMQA(nn.Module):
    """q in 4 heads; k, v one head each, expanded to 4 heads; SDPA; then an MLP."""

    def __init__(self, norm_k=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, D), nn.Linear(H, D)
        self.k_norm = nn.Parameter(torch.rand(D) + 0.5) if norm_k else None
        self.o = nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k = self.k(x)
        if self.k_norm is not None:  # OLMo-2's RMS norm over the whole k projection
            k = self.k_norm * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6))
        k = k.view(b, t, 1, D).transpose(1, 2).expand(b, HEADS, t, D)
        v = self.v(x).view(b, t, 1, D).transpose(1, 2).expand(b, HEADS, t, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(x)))


def _planned(model, tp):
    torch.manual_seed(0)
    cap = captured(model, x_batch())
    decision = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, decision)
    return cap, decision


def test_expanded_one_kv_head_is_copied_and_attention_sharded():
    torch.manual_seed(0)
    model = ExpandMQA()
    cap, d = _planned(model, 4)
    assert {"q.weight", "k.weight", "v.weight", "up.weight"} <= d.column
    assert d.layouts["k.weight"].kind == d.layouts["v.weight"].kind == "replicated_heads"
    assert not d.redistributions, [r.kind for r in d.redistributions]
    assert_tp_matches(model, x_batch(), 4, d, cap.gm)
    # each rank holds the one kv head whole: k and v are not counted sharded
    assert tp_summary(d, model).startswith(
        "tensor parallel: no repeated blocks found; 4 of 6 weight matrices in the model"), \
        tp_summary(d, model)


def test_one_kv_head_normed_whole_is_kept_whole_not_split_along_head_dim():
    torch.manual_seed(0)
    model = ExpandMQA(norm_k=True)
    cap, d = _planned(model, 2)
    assert "k.weight" not in d.column and {"q.weight", "o.weight"} <= d.column | d.row
    assert any(line.startswith("kept whole: k.weight (its output is one head")
               for line in d.report), d.report
    # q is never gathered: attention runs on each rank's query heads
    assert not [r for r in d.redistributions if r.kind == "all_gather"], d.report
    assert_tp_matches(model, x_batch(), 2, d, cap.gm)


class PerKvHeadNorm(nn.Module):
    """6 query heads, 2 kv heads with a per-kv-head layer norm weight (KV, D), repeat_kv;
    then an MLP where ``mlp``."""

    def __init__(self, mlp=True):
        super().__init__()
        self.up, self.down = (nn.Linear(H, 2 * H), nn.Linear(2 * H, H)) if mlp else (None, None)
        self.q, self.k, self.v = nn.Linear(H, 6 * D), nn.Linear(H, 2 * D), nn.Linear(H, 2 * D)
        self.kw = nn.Parameter(torch.rand(2, D) + 0.5)
        self.o = nn.Linear(6 * D, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 6, D).transpose(1, 2)
        k = (F.layer_norm(self.k(x).view(b, t, 2, D), (D,)) * self.kw).transpose(1, 2)
        v = self.v(x).view(b, t, 2, D).transpose(1, 2)
        k = k[:, :, None].expand(b, 2, 3, t, D).reshape(b, 6, t, D)
        v = v[:, :, None].expand(b, 2, 3, t, D).reshape(b, 6, t, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, 6 * D))
        return x if self.up is None else x + self.down(F.gelu(self.up(x)))


def test_heads_tp_cannot_divide_are_named_as_the_cause():
    torch.manual_seed(0)
    model = PerKvHeadNorm()
    cap, d = _planned(model, 4)
    assert d.column == {"up.weight"}
    (line,) = [x for x in d.report if x.startswith("kept replicated: k.weight")]
    assert "the cause: tp = 4 does not divide the 6 heads" in line, line
    assert_tp_matches(model, x_batch(), 4, d, cap.gm)


def test_nothing_sharded_error_names_the_heads_as_the_cause():
    torch.manual_seed(0)
    cap = captured(PerKvHeadNorm(mlp=False), x_batch())
    with pytest.raises(PlanError, match=r"mesh.tp=4 but no weight matrix could be sharded; "
                       r".*the cause: tp = 4 does not divide the 6 heads"):
        plan_tp(cap.gm.graph, 4)
