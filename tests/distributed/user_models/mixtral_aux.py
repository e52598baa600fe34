"""Mixtral returning its router auxiliary (load-balancing) loss in ``outputs.loss``
(``output_router_logits=True``): expert parallelism must leave it, and its gradients, as the
model computes them on each rank's tokens."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64


def build_model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, use_cache=False, router_jitter_noise=0.0,
                               output_router_logits=True, router_aux_loss_coef=0.5)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
