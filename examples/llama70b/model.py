"""HF LlamaForCausalLM with a Llama-3-70B-sized config.

Meant to be built on the meta device only (by the compiler): a real fp32 build would
need ~282 GB. build_model() itself does not force meta; callers wrap it in
`with torch.device("meta"):`.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 128256
BATCH = 2
SEQ = 16


def make_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(make_config())


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
