"""A Llama 3 written as Meta's reference model.py and torchtitan's llama3 write it (plain
PyTorch, no transformers): the rotary table ``freqs_cis`` is a complex64 buffer from
``torch.polar``, q and k are rotated with ``torch.view_as_complex`` / ``view_as_real``, GQA
repeats the kv heads with ``torch.repeat_interleave``, RMSNorm computes in fp32, SwiGLU MLP,
untied output head. 4 layers, 4 query heads, 2 kv heads (issue 23, part 4).
``build_model(shared_rotary=True)``: the table lives in one ``Rotary`` module that every
block holds (``layers.i.attention.rope`` is one module, its buffer one tensor under 5
names) and each block reads it itself, as models that pass a rotary module to their layers
do.

Contract: build_model(), example_inputs(), loss_fn(outputs, batch).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ, BATCH = 64, 4, 4, 2, 128, 16, 8


def precompute_freqs_cis(dim, end, theta=500000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Rotary(nn.Module):
    """The rotary table as a module: ``rope(seqlen)`` is its first ``seqlen`` rows."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // HEADS, 2 * SEQ),
                             persistent=True)

    def forward(self, seqlen):
        return self.freqs_cis[:seqlen]


class Attention(nn.Module):
    def __init__(self, kv_heads):
        super().__init__()
        self.rope = None  # set to the model's one Rotary when it is shared
        self.n_heads, self.n_kv_heads = HEADS, kv_heads
        self.n_rep = HEADS // kv_heads
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        if self.rope is not None:
            freqs_cis = self.rope(seqlen)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = torch.repeat_interleave(xk, self.n_rep, dim=2)
        values = torch.repeat_interleave(xv, self.n_rep, dim=2)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, kv_heads):
        super().__init__()
        self.attention = Attention(kv_heads)
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, kv_heads=KV_HEADS, shared_rotary=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock(kv_heads) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if shared_rotary:
            self.rope = Rotary()
            for layer in self.layers:
                layer.attention.rope = self.rope
            self.freqs_cis = None
        else:
            self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // HEADS, 2 * SEQ),
                                 persistent=True)

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = None if self.freqs_cis is None else self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def build_model(kv_heads=KV_HEADS, shared_rotary=False):
    torch.manual_seed(0)
    return Transformer(kv_heads, shared_rotary)


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),)


def loss_fn(outputs, batch):
    tokens = batch[0]
    return F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
