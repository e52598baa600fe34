"""A rotary table one module caches for every block, as rotary-embedding-torch's
``cache_if_possible`` does (FLASH-pytorch hands one RotaryEmbedding to every layer): the
first call fills ``cached`` and the later ones read it (frontend/buffer_reads.py).
``CACHE_REGION`` changes the region the later calls read and ``SCALE_AFTER_WRITE`` writes the
table after caching it (tests of what is not forwarded)."""
import torch
import torch.nn.functional as F
from torch import nn

D, H, V = 32, 4, 64
CACHE_REGION = None  # None: the region written; else a function of (buffer, n)
SCALE_AFTER_WRITE = False


class Rotary(nn.Module):
    def __init__(self, dim=D // H):
        super().__init__()
        freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.freqs = nn.Parameter(freqs, requires_grad=False)
        self.register_buffer("cached", torch.zeros(64, dim), persistent=False)
        self.cached_len = 0

    def forward(self, n):
        if n <= self.cached_len:
            region = self.cached[:n] if CACHE_REGION is None else CACHE_REGION(self.cached, n)
            return region.detach()
        f = torch.einsum("i,j->ij", torch.arange(n, dtype=self.freqs.dtype), self.freqs)
        f = f.repeat_interleave(2, -1)
        table = f.detach()
        self.cached[:n] = table
        if SCALE_AFTER_WRITE:
            table.mul_(2.0)
        self.cached_len = n
        return f


def rotate(x, f):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return x * f.cos() + torch.stack((-x2, x1), -1).flatten(-2) * f.sin()


class Block(nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.rotary = rotary
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        f = self.rotary(t)
        y = F.scaled_dot_product_attention(rotate(q, f), rotate(k, f), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        rotary = Rotary()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(rotary) for _ in range(4))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(1)),)


def loss_fn(out, batch):
    ids = batch[0]
    return F.cross_entropy(out[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
