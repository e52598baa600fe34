"""A Mixtral (transformers' ``MixtralForCausalLM``, grouped-mm experts) sized so that the
experts dominate a step: the expert-parallel benchmarks (benchmarks/moe.py) compile it at
dp2 x ep2 and tp2, and count its all-to-alls (benchmarks/communication.py ``--moe``).

``PZ_BENCH_SIZE=quick`` selects a tiny size for the smoke test. ``PZ_BENCH_ROUTING=skewed``
makes the routing uneven: every token embedding gets +``SKEW_OFFSET`` on hidden dim 0 (so
after the RMSNorm that dim is large and positive for every token) and the router rows of
experts 0 and 1 read that dim with ``SKEW_WEIGHTS`` in every layer, so they are most
tokens' top-2: at ep2 ep rank 0 (experts [0, E/2)) receives most rows, and rank 1's experts
few or none. The default is the random init's routing.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

SIZES = {  # hidden, FFN per expert, layers, heads, kv heads, experts, top-k, vocab, batch, seq
    "full": dict(hidden=256, inter=512, layers=4, heads=8, kv=4, experts=8, top_k=2, vocab=1024,
                 batch=8, seq=64),
    "quick": dict(hidden=32, inter=64, layers=2, heads=4, kv=2, experts=4, top_k=2, vocab=64,
                  batch=8, seq=8),
}
SIZE = SIZES[os.environ.get("PZ_BENCH_SIZE", "full")]
ROUTING = os.environ.get("PZ_BENCH_ROUTING", "random")
SKEW_OFFSET, SKEW_WEIGHTS = 0.1, (1.0, 0.8)  # experts 0 and 1: both on ep rank 0 at ep2


def make_config() -> MixtralConfig:
    return MixtralConfig(
        vocab_size=SIZE["vocab"], hidden_size=SIZE["hidden"], intermediate_size=SIZE["inter"],
        num_hidden_layers=SIZE["layers"], num_attention_heads=SIZE["heads"],
        num_key_value_heads=SIZE["kv"], num_local_experts=SIZE["experts"],
        num_experts_per_tok=SIZE["top_k"], max_position_embeddings=max(128, SIZE["seq"]),
        tie_word_embeddings=False, use_cache=False, router_jitter_noise=0.0,
        attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = MixtralForCausalLM(make_config())
    if ROUTING == "skewed":
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += SKEW_OFFSET
            for layer in model.model.layers:
                for e, w in enumerate(SKEW_WEIGHTS):
                    layer.mlp.gate.weight[e, 0] = w
    elif ROUTING != "random":
        raise ValueError(f"PZ_BENCH_ROUTING={ROUTING!r}: use 'random' or 'skewed'")
    return model


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
