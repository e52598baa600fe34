"""cast_linear (external): a GPT in the style of modded-nanogpt, whose linears cast their
weight to the activation's dtype before the matmul (``F.linear(x, self.weight.to(x.dtype))``,
as mixed-precision and fp8 training code writes it), with weight-free RMSNorm
(``F.rms_norm``) on the residual and on q/k per head, rotary from cos/sin buffers, and a
relu^2 MLP. (modded-nanogpt zero-initialises its output projections; here they are random,
so that every gradient is non-trivial at the first step.)

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BATCH, SEQ = 96, 4, 16
DIM, HEADS, LAYERS = 32, 4, 2


class CastedLinear(nn.Linear):
    """nn.Linear whose weight (and bias) follow the input's dtype."""

    def forward(self, x):
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, head_dim, max_seq_len=64, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(max_seq_len).float()
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x):  # x: (B, T, H, D)
        T = x.size(1)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = CastedLinear(dim, dim, bias=False)
        self.k = CastedLinear(dim, dim, bias=False)
        self.v = CastedLinear(dim, dim, bias=False)
        self.c_proj = CastedLinear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        q = self.q(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k(x).view(B, T, self.num_heads, self.head_dim)
        v = self.v(x).view(B, T, self.num_heads, self.head_dim)
        q, k = norm(q), norm(k)  # QK norm, per head
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view_as(x)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim, bias=False)
        self.c_proj = CastedLinear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(norm(x))
        x = x + self.mlp(norm(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, model_dim=DIM):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList([Block(model_dim, num_heads) for _ in range(num_layers)])
        self.lm_head = CastedLinear(model_dim, vocab_size, bias=False)

    def forward(self, idx):
        x = norm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(norm(x))


def build_model():
    torch.manual_seed(0)
    return GPT()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),)


def loss_fn(outputs, batch):
    """Next-token cross-entropy, mean over positions."""
    (idx,) = batch
    logits = outputs[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), idx[:, 1:].reshape(-1))
