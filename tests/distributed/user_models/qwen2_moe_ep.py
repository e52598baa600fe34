"""A tiny Qwen2-MoE (softmax top-k without renormalisation, a shared expert with a sigmoid
gate beside the routed experts): the second expert-parallel architecture."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64


def build_model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, shared_expert_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                               max_position_embeddings=64, use_cache=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
