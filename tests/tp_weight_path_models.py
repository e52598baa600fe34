"""Plain PyTorch models whose weights reach the matmul another way than ``nn.Linear`` does
(issue 23, part 4: "any weight path"), shared by tests/features/test_weight_paths.py:
parameters cast, viewed or transposed in forward, GQA by ``repeat_interleave``, a fused qkv
sliced by sizes with per-head parameters. Hidden 32, 4 query heads."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, HEADS = 32, 4


class CastLinear(nn.Module):
    """A linear whose weight and bias are read through ``mode``: ``to`` (``F.linear(x,
    w.to(x.dtype), b.to(x.dtype))``, mixed-precision code), ``type_as``, ``view`` (the same
    2-D shape), ``io`` (stored (in, out), ``F.linear(x, w.t(), b)``), ``matmul_to``
    (``x @ w.to(x.dtype).t() + b``), ``float_T`` (``torch.matmul(x, w.float().T) + b``)."""

    def __init__(self, i: int, o: int, mode: str):
        super().__init__()
        self.mode = mode
        self.weight = nn.Parameter(torch.randn((i, o) if mode == "io" else (o, i)) / i ** 0.5)
        self.bias = nn.Parameter(torch.randn(o) / 10)

    def forward(self, x):
        w, b, mode = self.weight, self.bias, self.mode
        if mode == "to":
            return F.linear(x, w.to(x.dtype), b.to(x.dtype))
        if mode == "type_as":
            return F.linear(x, w.type_as(x)) + b.type_as(x)
        if mode == "view":
            return F.linear(x, w.view(w.shape[0], w.shape[1]), b.view(-1))
        if mode == "io":
            return F.linear(x, w.t(), b)
        if mode == "matmul_to":
            return x @ w.to(x.dtype).t() + b
        if mode == "float_T":
            return torch.matmul(x, w.float().T) + b
        raise ValueError(mode)


class CastAttention(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.q, self.k, self.v, self.o = (CastLinear(H, H, mode) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, H))


class CastBlock(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.attn = CastAttention(mode)
        self.up, self.down = CastLinear(H, 2 * H, mode), CastLinear(2 * H, H, mode)
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class CastNet(nn.Module):
    def __init__(self, mode: str = "to"):
        super().__init__()
        self.layers = nn.ModuleList(CastBlock(mode) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def x_batch(b=2, t=6, seed=0):
    return (torch.randn(b, t, H, generator=torch.Generator().manual_seed(seed)),)


class ComplexBlock(nn.Module):
    """A residual MLP on a complex hidden state (H / 2 complex features), viewed as real for
    the matmuls and back with ``unflatten(-1, (H / 2, 2))``: the unflatten's size is on the
    dim tp shards between blocks (this block's down is column_parallel, the next one's up row)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, z):
        x = torch.view_as_real(z).flatten(-2)
        x = x + self.down(torch.relu(self.up(x)))
        return torch.view_as_complex(x.unflatten(-1, (H // 2, 2)).contiguous())


class ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(H // 2, H), nn.Linear(H, 8)
        self.layers = nn.ModuleList(ComplexBlock() for _ in range(4))

    def forward(self, x):
        z = torch.view_as_complex(self.inp(x).unflatten(-1, (H // 2, 2)).contiguous())
        for layer in self.layers:
            z = layer(z)
        return self.out(torch.view_as_real(z).flatten(-2))


def half_batch(b=2, t=6, seed=0):
    return (torch.randn(b, t, H // 2, generator=torch.Generator().manual_seed(seed)),)


class SplitQKVAttention(nn.Module):
    """GQA with one fused q|k|v projection split by unequal sizes (``torch.split(qkv, [q, k,
    v], -1)``: 4 query heads, ``kv`` kv heads of 8), then per-head parameters: a learned gain
    per query head and per kv head (``(heads, 1, 1)``, broadcast over the head-major q / k)."""

    def __init__(self, kv: int = 2):
        super().__init__()
        self.kv, self.hd = kv, H // HEADS
        self.qkv = nn.Linear(H, (HEADS + 2 * kv) * self.hd)
        self.q_gain = nn.Parameter(1 + torch.randn(HEADS, 1, 1) / 10)
        self.k_gain = nn.Parameter(1 + torch.randn(kv, 1, 1) / 10)
        self.o = nn.Linear(H, H)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = torch.split(self.qkv(x), [HEADS * self.hd, self.kv * self.hd, self.kv * self.hd],
                              dim=-1)
        q = q.view(B, T, HEADS, self.hd).transpose(1, 2) * self.q_gain
        k = k.view(B, T, self.kv, self.hd).transpose(1, 2) * self.k_gain
        v = v.view(B, T, self.kv, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, H))


class SplitQKVNet(nn.Module):
    def __init__(self, kv: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(SplitQKVAttention(kv) for _ in range(2))
        self.ups = nn.ModuleList(nn.Linear(H, 2 * H) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(2 * H, H) for _ in range(2))

    def forward(self, x):
        for attn, up, down in zip(self.layers, self.ups, self.downs):
            x = x + attn(F.layer_norm(x, (H,)))
            x = x + down(F.gelu(up(F.layer_norm(x, (H,)))))
        return x


class TiedVOAttention(nn.Module):
    """The output projection is the value projection's weight transposed (``y @ W_v``): one
    parameter read as a column weight's (out, in) and, transposed, as a row weight's."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(H, H, bias=False) for _ in range(3))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + F.linear(y.transpose(1, 2).reshape(b, t, H), self.v.weight.t())


class TiedVONet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(TiedVOAttention() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LoRALinear(nn.Module):
    """A linear with a low-rank adapter, as peft's LoRA adds one: ``base(x) + s * B(A(x))``
    (rank 4); ``adapter_first`` adds them the other way round. ``frozen``: the base is not
    trained (``requires_grad_(False)``), as in LoRA fine-tuning."""

    def __init__(self, i: int, o: int, adapter_first: bool, frozen: bool):
        super().__init__()
        self.base = nn.Linear(i, o)
        self.base.requires_grad_(not frozen)
        self.A = nn.Parameter(torch.randn(4, i) / i ** 0.5)
        self.B = nn.Parameter(torch.randn(o, 4) / 2)
        self.adapter_first = adapter_first

    def forward(self, x):
        if self.adapter_first:
            return 2.0 * F.linear(F.linear(x, self.A), self.B) + self.base(x)
        return self.base(x) + 2.0 * F.linear(F.linear(x, self.A), self.B)


class LoRABlock(nn.Module):
    def __init__(self, adapter_first: bool, frozen: bool):
        super().__init__()
        self.q, self.v, self.o, self.up, self.down = (
            LoRALinear(i, o, adapter_first, frozen)
            for i, o in ((H, H), (H, H), (H, H), (H, 2 * H), (2 * H, H)))
        self.k = nn.Linear(H, H)
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, H))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LoRANet(nn.Module):
    def __init__(self, adapter_first: bool = False, frozen: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(LoRABlock(adapter_first, frozen) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
