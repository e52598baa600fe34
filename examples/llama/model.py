"""A tiny HF LlamaForCausalLM (GQA, tied embeddings).

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 128
BATCH = 8
SEQ = 16


def make_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        use_cache=False,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(make_config())
    # Make sure the tie holds (post_init ties, but be explicit about it).
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _random_ids(seed, batch=BATCH, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (batch, seq), generator=g, dtype=torch.long)


def example_inputs():
    return {"input_ids": _random_ids(1234)}


def loss_fn(outputs, batch):
    """Next-token cross-entropy, mean over all (equal-length) positions."""
    logits = outputs.logits[:, :-1, :]
    targets = batch["input_ids"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batches(n=100, seed=0):
    for i in range(n):
        yield {"input_ids": _random_ids(seed * 100003 + i + 1)}
