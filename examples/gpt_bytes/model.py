"""The GPT example (nanoGPT style, separate q/k/v) over bytes: a vocabulary of 256 token
ids, trained on token files through the spec's ``data:`` section (no ``batches()``: data
files, else synthetic batches). ``benchmarks/corpus.py`` writes such a file from the Python
standard library's own sources.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256  # bytes
BLOCK_SIZE = 128
N_LAYER = 4
N_HEAD = 4
N_EMBD = 64
BATCH = 8
SEQ = 32


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        h = self.ln_1(x)
        q, k, v = (f(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, N_EMBD)
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.blocks = nn.ModuleList([Block(N_EMBD, N_HEAD) for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB_SIZE, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randint(0, VOCAB_SIZE, (BATCH, SEQ), generator=g, dtype=torch.long),)


def loss_fn(outputs, batch):
    """Next-byte cross-entropy, mean over all (equal-length) positions."""
    (idx,) = batch
    logits = outputs[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
