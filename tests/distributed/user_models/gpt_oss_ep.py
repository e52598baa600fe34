"""A tiny GPT-OSS: stacked experts with per-expert biases (gate_up_proj_bias (E, 2F),
down_proj_bias (E, H)) beside the stacked weights, gate and up interleaved in gate_up
(``[..., ::2]``, ``[..., 1::2]``), sink tokens in attention, sliding and full layers."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64


def build_model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt_oss", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                               max_position_embeddings=64, use_cache=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # the experts' biases start at zero: make them count
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    return model


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
