"""The tiny Mixtral of ``mixtral_auto.py`` with its own batches (8 rows, a fresh draw per
step, labels = inputs: the loss is the model's ``outputs.loss``), so a test can rerun the same
steps on the unmodified model: 8 rows give every rank of dp4 two, every expert some."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64


def build_model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, use_cache=False, router_jitter_noise=0.0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batch(seed: int):
    ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def example_inputs():
    return _batch(1)


def batches(n=100):
    for i in range(n):
        yield _batch(100 + i)
