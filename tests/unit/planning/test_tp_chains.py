"""Chains of linears within a block (decision 99): the walks paired DeepSeek's multi-head
latent attention as ``q_a`` column / ``q_b`` row and ``kv_a`` column / ``kv_b`` row, so the
low rank was sharded, both up-projections' outputs were all-reduced and every rank computed
attention whole (a held-out zoo counted it "16 of 16 sharded"). Kept whole, the low-rank
projections leave ``q_b`` and ``kv_b`` column-parallel over heads and ``o`` their row, as
Megatron-LM shards MLA (DeepSeek-V2, Liu et al. 2024, §2.1). A chain that would lose a
sharded weight that way (linears stacked with no residual) keeps its pairs.

Each rank equals the model: outputs, every gradient, one SGD step (fp32, 1e-5)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check

D, H, RANK, NOPE, ROPE, V = 32, 4, 16, 8, 4, 8


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class MLA(nn.Module):
    """q and kv through low-rank projections with a norm between; a rope key shared by
    every head (``k_pe``), expanded to the heads; SDPA; the output projection."""

    def __init__(self):
        super().__init__()
        self.q_a, self.q_norm = nn.Linear(D, RANK, bias=False), RMSNorm(RANK)
        self.q_b = nn.Linear(RANK, H * (NOPE + ROPE), bias=False)
        self.kv_a, self.kv_norm = nn.Linear(D, RANK + ROPE, bias=False), RMSNorm(RANK)
        self.kv_b = nn.Linear(RANK, H * (NOPE + V), bias=False)
        self.o = nn.Linear(H * V, D, bias=False)
        self.n1 = RMSNorm(D)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.q_b(self.q_norm(self.q_a(h))).view(b, t, H, NOPE + ROPE).transpose(1, 2)
        c, k_pe = torch.split(self.kv_a(h), [RANK, ROPE], dim=-1)
        kv = self.kv_b(self.kv_norm(c)).view(b, t, H, NOPE + V).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, V], dim=-1)
        k_pe = k_pe.view(b, t, 1, ROPE).transpose(1, 2).expand(b, H, t, ROPE)
        k = torch.cat([k_nope, torch.tanh(k_pe)], -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           scale=1 / math.sqrt(NOPE + ROPE))
        return x + self.o(y.transpose(1, 2).reshape(b, t, H * V))


def test_latent_attention_shards_heads_not_the_rank():
    torch.manual_seed(0)
    d = plan_and_check(MLA(), (torch.randn(2, 6, D),), 2)
    assert d.column == {"q_b.weight", "kv_b.weight"} and d.row == {"o.weight"}, d.report
    assert any(line.startswith("kept whole, the head of a chain of linears: kv_a.weight, "
                               "q_a.weight") for line in d.report), d.report
    assert d.replicated["q_a.weight"][0].startswith(
        "replicated linear: q_a.weight (the head of a chain of linears, kept whole: the linears "
        "it feeds are column_parallel over heads (q_b.weight) and the chain's end their row, ")
    # the shared rope key is cut to each rank's heads locally, never all-reduced
    assert {r.kind for r in d.redistributions} == {"scatter"}, d.redistributions


class Stack(nn.Module):
    """Four linears with no residual between: kept as two Megatron pairs, since keeping
    ``a`` whole would leave ``d`` replicated."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        return self.d(F.gelu(self.c(F.gelu(self.b(F.gelu(self.a(x)))))))


def test_chain_that_would_lose_a_matrix_keeps_its_pairs():
    torch.manual_seed(0)
    d = plan_and_check(Stack(), (torch.randn(2, 3, D),), 2)
    assert (d.column, d.row) == ({"a.weight", "c.weight"}, {"b.weight", "d.weight"})


def test_transformers_deepseek_v3_keys_written_into_new_empty_stay_sharded():
    """transformers' DeepSeek-V3 builds each key by ``copy_`` of head-sharded ``k_nope`` and
    the shared rope key into the slices of a ``new_empty`` (``expand_kv``). An in-place op
    keeps its target's placement, so the keys were all-gathered into a whole ``new_empty``
    and cut again for attention; the ``new_empty`` is now made with the rank's heads (its
    heads constant local) and only the shared rope key is cut, locally."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    class Loss(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    torch.manual_seed(0)
    d = plan_and_check(Loss(DeepseekV3ForCausalLM(cfg)), (torch.randint(0, 64, (2, 6)),), 2)
    attn = "m.model.layers.0.self_attn."
    assert {attn + "q_b_proj.weight", attn + "kv_b_proj.weight"} <= d.column
    assert attn + "o_proj.weight" in d.row
    assert [(r.kind, "expand" in r.producer) for r in d.redistributions] == [("scatter", True)]


class KvFromLinear(nn.Module):
    """torch's attention with kdim/vdim keys and values from a linear, its weights returned
    (need_weights, the module's default) and read: the walks pair ``kv_in`` with k_proj and
    v_proj, whose shared in_proj_bias then keeps q_proj, out_proj and the attention whole
    on every rank; the heads plan sends as many bytes here and shards more (zoo 20 Z4: 6 of
    10 matrices at tp2, 8 of 10 now)."""

    def __init__(self):
        super().__init__()
        self.kv_in = nn.Linear(2 * D, 48)
        self.mha = nn.MultiheadAttention(2 * D, H, batch_first=True, kdim=48, vdim=48)

    def forward(self, x):
        a, w = self.mha(x, self.kv_in(x), self.kv_in(x), average_attn_weights=True)
        return x + a + w.mean(-1, keepdim=True)


def test_the_plan_sharding_more_parameters_is_taken_at_equal_bytes():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 2 * D, generator=torch.Generator().manual_seed(1))
    d = plan_and_check(nn.Sequential(KvFromLinear(), KvFromLinear()), (x,), 2)
    for i in range(2):
        assert {f"{i}.mha.{w}_proj_weight" for w in "qkv"} <= d.column, d.report
        assert f"{i}.mha.out_proj.weight" in d.row and f"{i}.kv_in.weight" not in d.column
    assert any("more parameter elements sharded" in line for line in d.report), d.report
