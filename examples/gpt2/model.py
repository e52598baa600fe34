"""A tiny HF GPT2LMHeadModel (Conv1D projections, fused q|k|v in ``c_attn``, tied embeddings).

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 256
BATCH = 8
SEQ = 16


def make_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=64,
        n_embd=64,
        n_layer=4,
        n_head=4,
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(make_config())
    if model.lm_head.weight is not model.transformer.wte.weight:
        model.lm_head.weight = model.transformer.wte.weight
    assert model.lm_head.weight is model.transformer.wte.weight
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
