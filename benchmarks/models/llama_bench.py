"""The Llama example (examples/llama) scaled up so that a training step is long enough to
time (>= 0.2 s on gloo/CPU at world 4): HF ``LlamaForCausalLM`` with GQA, untied embedding
and LM head (as Llama-3-8B/70B). ``PZ_BENCH_SIZE=quick`` selects a tiny size for the smoke
test.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab, batch, seq
    "full": dict(hidden=256, inter=704, layers=4, heads=8, kv=4, vocab=4096, batch=8, seq=128),
    "quick": dict(hidden=64, inter=128, layers=4, heads=4, kv=2, vocab=256, batch=8, seq=16),
}
SIZE = SIZES[os.environ.get("PZ_BENCH_SIZE", "full")]


def make_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=SIZE["vocab"],
        hidden_size=SIZE["hidden"],
        intermediate_size=SIZE["inter"],
        num_hidden_layers=SIZE["layers"],
        num_attention_heads=SIZE["heads"],
        num_key_value_heads=SIZE["kv"],
        max_position_embeddings=max(128, SIZE["seq"]),
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(make_config())


def _random_ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZE["vocab"], (SIZE["batch"], SIZE["seq"]), generator=g, dtype=torch.long)


def example_inputs():
    return {"input_ids": _random_ids(1234)}


def loss_fn(outputs, batch):
    """Next-token cross-entropy, mean over all (equal-length) positions."""
    logits = outputs.logits[:, :-1, :]
    targets = batch["input_ids"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batches(n=1000, seed=0):
    for i in range(n):
        yield {"input_ids": _random_ids(seed * 100003 + i + 1)}
