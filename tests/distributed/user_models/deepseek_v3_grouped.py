"""A tiny DeepSeek-V3 with group-limited routing (n_group=2, topk_group=1: each token picks
its top-2 experts within the best of 2 groups of 2, sigmoid scores with a correction bias,
renormalised and scaled), a shared expert beside the routed ones, multi-head latent
attention, the first layer dense: the third expert-parallel architecture."""
import torch
import transformers as T

VOCAB = 96


def build_model():
    torch.manual_seed(0)
    config = T.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, use_cache=False,
        attn_implementation="sdpa")
    model = T.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # a bias that changes which group wins for some tokens
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return model


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
