"""Mixture-of-experts and hybrid (state-space + attention) Hugging Face families the suite
does not use (Mixtral and Qwen2-MoE are in it). Routers' jitter stays at each config's
default; mamba layers run their pure-PyTorch path (no CUDA kernels on CPU)."""
from __future__ import annotations

from .decoders import llama_like
from .family import VOCAB, hf

MOE = {"num_experts_per_tok": 2}

MOE_FAMILIES = [
    hf("olmoe", "moe", "q/k RMSNorm over the whole projection, 4 experts top-2 (stacked expert "
       "weights)", "OlmoeConfig", "OlmoeForCausalLM",
       llama_like(head_dim=None, num_experts=4, **MOE)),
    hf("qwen3_moe", "moe", "per-head q/k RMSNorm, 4 experts top-2 with normalised top-k",
       "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
       llama_like(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, **MOE)),
    hf("granitemoe", "moe", "ParallelExperts (3-D weights, its own top-k gating), multipliers",
       "GraniteMoeConfig", "GraniteMoeForCausalLM",
       llama_like(head_dim=None, num_local_experts=4, **MOE)),
    hf("phimoe", "moe", "sparsemixer routing (Gumbel sampling in training), LayerNorm, qkv bias",
       "PhimoeConfig", "PhimoeForCausalLM",
       llama_like(head_dim=None, num_local_experts=4, **MOE)),
    hf("jetmoe", "moe", "mixture of attention heads (MoA: routed q/o experts over shared k/v) "
       "and MoE MLP", "JetMoeConfig", "JetMoeForCausalLM",
       {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "kv_channels": 8, "intermediate_size": 64, "max_position_embeddings": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}),
    hf("dbrx", "moe", "fused Wqkv split by sizes (GQA, kv 2), clip_qkv, 4 experts top-2 "
       "(attn_config needs rope_theta: transformers 5.24's DbrxAttention reads it)",
       "DbrxConfig", "DbrxForCausalLM",
       {"vocab_size": VOCAB, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    hf("deepseek_v2", "moe", "multi-head latent attention (kv low-rank, q full), complex rotary "
       "(torch.polar / view_as_complex), 4 routed + 1 shared expert", "DeepseekV2Config",
       "DeepseekV2ForCausalLM",
       llama_like(head_dim=None, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_group=1, topk_group=1, topk_method="greedy", **MOE)),
    hf("switch_transformers", "moe", "T5 with top-1 routed experts every other layer, expert "
       "capacity, router jitter 0.01", "SwitchTransformersConfig",
       "SwitchTransformersForConditionalGeneration",
       {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
        "num_decoder_layers": 2, "num_heads": 4, "num_experts": 4, "expert_capacity": 16,
        "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1,
        "relative_attention_num_buckets": 8, "decoder_start_token_id": 0, "pad_token_id": 0,
        "eos_token_id": 2}, inputs="seq2seq", attn="eager"),
]

HYBRID_FAMILIES = [
    hf("jamba", "hybrid", "mamba layer (depthwise causal conv1d, selective scan) then an attention "
       "layer with MoE", "JambaConfig", "JambaForCausalLM",
       llama_like(head_dim=None, num_experts=4, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                  mamba_dt_rank=4, use_mamba_kernels=False, **MOE)),
    hf("bamba", "hybrid", "mamba2 mixer (chunked SSD scan, gated RMSNorm) and an attention layer",
       "BambaConfig", "BambaForCausalLM",
       llama_like(head_dim=None, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)),
    hf("lfm2", "hybrid", "gated short-convolution layers (depthwise conv1d) and GQA attention "
       "layers with per-head q/k norm", "Lfm2Config", "Lfm2ForCausalLM",
       llama_like(head_dim=None, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    hf("mamba", "hybrid", "attention-free: mamba mixer (in_proj, depthwise conv1d, x_proj, dt_proj, "
       "selective scan, out_proj)", "MambaConfig", "MambaForCausalLM",
       {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8,
        "expand": 2, "conv_kernel": 4, "time_step_rank": 4, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}, attn="eager"),
]

FAMILIES = MOE_FAMILIES + HYBRID_FAMILIES
