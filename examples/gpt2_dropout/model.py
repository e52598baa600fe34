"""A tiny HF GPT2LMHeadModel with Hugging Face's default dropout (embd, attn and resid
pdrop 0.1), trained on sequences it can learn, so dropout shows in the loss.

The same architecture as examples/gpt2 (Conv1D projections, fused q|k|v, tied embeddings).
Each training sequence is an arithmetic progression modulo the vocabulary (random start,
step 1-3): the next token follows from the previous two, and with dropout the training loss
falls visibly slower than without (tests/distributed/test_dropout_training.py relies on that).

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
    return GPT2Config(  # dropout left at the defaults: resid, embd and attn pdrop 0.1
        vocab_size=VOCAB_SIZE,
        n_positions=64,
        n_embd=64,
        n_layer=4,
        n_head=4,
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(make_config())
    if model.lm_head.weight is not model.transformer.wte.weight:
        model.lm_head.weight = model.transformer.wte.weight
    return model


def _progressions(seed, batch=BATCH, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB_SIZE, (batch, 1), generator=g)
    step = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + step * torch.arange(seq)) % VOCAB_SIZE


def example_inputs():
    return {"input_ids": _progressions(1234)}


def loss_fn(outputs, batch):
    """Next-token cross-entropy, mean over all (equal-length) positions."""
    logits = outputs.logits[:, :-1, :]
    targets = batch["input_ids"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def batches(n=100, seed=0):
    for i in range(n):
        yield {"input_ids": _progressions(seed * 100003 + i + 1)}
