"""Qwen3: RMSNorm weights over head_dim on q and k (``q_norm`` / ``k_norm``) applied to
each tp rank's heads, so their gradients are Partial over tp and summed once per step
(``plan.grad_sync`` kind ``partial_tp``, runtime/step.py). Before issue 23 their gradients
were left unsummed and --verify failed on them."""
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def build_model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Qwen3ForCausalLM(cfg)


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 64, (4, 8), generator=g)}
