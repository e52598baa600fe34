"""Decoder-only Hugging Face families the suite does not use, each with what is new about its
attention or block (the reason it is in the zoo). Called with ``labels=`` (the loss inside
forward), as users fine-tune them."""
from __future__ import annotations

from .family import VOCAB, hf

# pad, bos, eos inside the tiny vocabulary
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def llama_like(**over) -> dict:
    """The shape every family here shares: hidden 32, 2 layers, 4 heads of 8, 2 kv heads."""
    base = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 64, **IDS}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def gpt_like(**over) -> dict:
    """GPT-2 style config names (n_embd, n_layer, n_head, n_positions)."""
    base = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
            "bos_token_id": 1, "eos_token_id": 2}
    base.update(over)
    return base


FAMILIES = [
    hf("qwen3", "decoder", "per-head q/k RMSNorm (q_norm, k_norm over head_dim) before rotary, GQA",
       "Qwen3Config", "Qwen3ForCausalLM", llama_like()),
    hf("olmo2", "decoder", "q/k RMSNorm over the whole projection (heads x head_dim), post-norm blocks",
       "Olmo2Config", "Olmo2ForCausalLM", llama_like(head_dim=None)),
    hf("cohere", "decoder", "parallel attention + MLP off one LayerNorm (no bias), per-head q/k "
       "LayerNorm (use_qk_norm, as Command R+), logit_scale, tied embeddings",
       "CohereConfig", "CohereForCausalLM", llama_like(head_dim=None, use_qk_norm=True)),
    hf("stablelm", "decoder", "partial rotary (25 %), qkv bias, per-head q/k LayerNorm held as a "
       "ModuleList of one LayerNorm per head (qk_layernorm, as StableLM-2-12B)",
       "StableLmConfig", "StableLmForCausalLM",
       llama_like(head_dim=None, use_qkv_bias=True, qk_layernorm=True)),
    hf("starcoder2", "decoder", "GQA with biases everywhere, LayerNorm, GELU MLP (c_fc/c_proj)",
       "Starcoder2Config", "Starcoder2ForCausalLM", llama_like(head_dim=None, use_bias=True)),
    hf("gpt_bigcode", "decoder", "multi-query attention inside one fused c_attn (q heads | one k | one v), "
       "dropout 0.1", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", gpt_like(multi_query=True)),
    hf("gptj", "decoder", "parallel attention + MLP, interleaved partial rotary (rotary_dim 4), "
       "q/k/v without bias", "GPTJConfig", "GPTJForCausalLM", gpt_like(rotary_dim=4)),
    hf("codegen", "decoder", "one qkv_proj split in mp_num=4 groups (q|v|k interleaved per group), "
       "partial rotary", "CodeGenConfig", "CodeGenForCausalLM", gpt_like(rotary_dim=4, n_ctx=64)),
    hf("persimmon", "decoder", "fused query_key_value viewed per head, per-head q/k LayerNorm, "
       "relu2 MLP, partial rotary (50 %)", "PersimmonConfig", "PersimmonForCausalLM",
       llama_like(head_dim=None, num_key_value_heads=None)),
    hf("granite", "decoder", "embedding / residual / attention multipliers and logits scaling "
       "(Granite-3 values)", "GraniteConfig", "GraniteForCausalLM",
       llama_like(head_dim=None, embedding_multiplier=12.0, residual_multiplier=0.22,
                  attention_multiplier=0.125, logits_scaling=8.0)),
    hf("glm", "decoder", "fused gate_up_proj split by chunk, qkv bias, interleaved partial rotary",
       "GlmConfig", "GlmForCausalLM", llama_like()),
    hf("nemotron", "decoder", "LayerNorm1P (weight + 1), relu2 MLP without gate, partial rotary",
       "NemotronConfig", "NemotronForCausalLM", llama_like()),
    hf("gemma2", "decoder", "attention and final logit soft-capping, alternating sliding-window "
       "layers, sandwich norms, query_pre_attn_scalar", "Gemma2Config", "Gemma2ForCausalLM",
       llama_like(sliding_window=8, query_pre_attn_scalar=8), attn="eager"),
    hf("gemma3", "decoder", "per-head q/k RMSNorm, local (sliding, own rotary base) and global layers",
       "Gemma3TextConfig", "Gemma3ForCausalLM",
       llama_like(sliding_window=8, query_pre_attn_scalar=8,
                  layer_types=["sliding_attention", "full_attention"])),
    hf("deepseek_v3", "decoder", "multi-head latent attention: low-rank q (q_a/q_b) and kv "
       "(kv_a_proj_with_mqa/kv_b) with RMSNorms between, decoupled rotary dims, then a routed "
       "MoE layer with a shared expert", "DeepseekV3Config", "DeepseekV3ForCausalLM",
       llama_like(head_dim=None, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                  moe_intermediate_size=32, first_k_dense_replace=1)),
    hf("diffllama", "decoder", "differential attention: two softmax maps subtracted with learned "
       "lambda_q1/k1/q2/k2 vectors, per-head GroupNorm-style RMSNorm", "DiffLlamaConfig",
       "DiffLlamaForCausalLM", llama_like()),
    hf("exaone4", "decoder", "per-head q/k RMSNorm, hybrid sliding/global layers, post-norm",
       "Exaone4Config", "Exaone4ForCausalLM",
       llama_like(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    hf("smollm3", "decoder", "NoPE layers (no rotary in every 2nd layer), GQA, tied embeddings",
       "SmolLM3Config", "SmolLM3ForCausalLM", llama_like(no_rope_layer_interval=2)),
    hf("mpt", "decoder", "ALiBi position bias, fused Wqkv, no biases, low-precision LayerNorm",
       "MptConfig", "MptForCausalLM",
       {"vocab_size": VOCAB, "d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2,
        "max_seq_len": 64, **IDS}, attn="eager"),
    hf("biogpt", "decoder", "learned positions with an offset, scaled embeddings, dropout 0.1",
       "BioGptConfig", "BioGptForCausalLM",
       {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, **IDS}),
    hf("xglm", "decoder", "sinusoidal positions computed from the ids (padding offset), dropout 0.1",
       "XGLMConfig", "XGLMForCausalLM",
       {"vocab_size": VOCAB, "d_model": 32, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64,
        "max_position_embeddings": 64, **IDS}, attn="eager"),
    hf("falcon_grouped", "decoder", "Falcon-40B's new decoder architecture: one query_key_value "
       "viewed as (kv groups, queries per group + 2, head_dim), each group's k and v selected out, "
       "two LayerNorms in parallel", "FalconConfig", "FalconForCausalLM",
       {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_kv_heads": 2, "new_decoder_architecture": True, "bias": False, "alibi": False,
        "max_position_embeddings": 64, **IDS}),
    hf("falcon_alibi", "decoder", "Falcon-RW's ALiBi multi-head attention: q|k|v interleaved "
       "per head in query_key_value (unflatten + unbind), the ALiBi bias inside the mask, "
       "sequential attention and MLP", "FalconConfig", "FalconForCausalLM",
       {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "multi_query": False, "new_decoder_architecture": False, "parallel_attn": False,
        "bias": True, "alibi": True, "max_position_embeddings": 64, **IDS}),
    hf("openai_gpt", "decoder", "post-LayerNorm GPT-1 with Conv1D c_attn (fused q|k|v), dropout 0.1",
       "OpenAIGPTConfig", "OpenAIGPTLMHeadModel",
       {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
       attn="eager"),
]
