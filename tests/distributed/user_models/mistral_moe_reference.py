"""A Mixtral in the style of Mistral's reference code (mistral-src ``moe.py``), not
transformers: the experts are an ``nn.ModuleList`` of SwiGLU MLPs and the layer loops over
them, each expert taking its rows by ``torch.where(selected_experts == i)`` and adding its
weighted output back with ``results[batch_idx] += ...``; softmax over the top-k logits (not
renormalised after top-k: it is the softmax of the k chosen). Per-module experts, so
``mesh.ep`` > 1 goes through the stack_experts pass."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, HEADS, EXPERTS, TOP_K, LAYERS = 64, 32, 48, 4, 4, 2, 2


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(FeedForward() for _ in range(EXPERTS))
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)

    def forward(self, inputs):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, TOP_K)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = MoeLayer()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        b, s, d = h.shape
        return h + self.feed_forward(self.ffn_norm(h).view(b * s, d)).view(b, s, d)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_model():
    torch.manual_seed(0)
    return Transformer()


def _batch(seed: int):
    return (torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed)),)


def example_inputs():
    return _batch(1)


def loss_fn(logits, batch):
    ids = batch[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def batches(n=100):
    for i in range(n):
        yield _batch(100 + i)
