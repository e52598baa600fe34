"""ft_transformer (external): an FT-Transformer for tabular data as yandex-research/rtdl
writes it, in plain PyTorch: a numerical feature tokenizer with per-feature weight and bias
parameters ``(n_features, d)`` applied by ``x[..., None] * weight + bias``, categorical
embeddings looked up through an ``offsets`` buffer (``x_cat + offsets[None]``), a CLS token
appended, pre-norm transformer blocks (fused-free W_q/W_k/W_v/W_out multi-head attention,
ReGLU feed-forward ``a * relu(b)`` from ``chunk(2, dim=-1)``, attention and residual
dropout), the first block without its attention norm, and a cross-entropy head on the CLS
token.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, N_NUM, CARDINALITIES, CLASSES = 8, 5, (3, 7, 4), 3


class NumericalFeatureTokenizer(nn.Module):
    def __init__(self, n_features, d_token, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_features, d_token))
        self.bias = nn.Parameter(torch.empty(n_features, d_token)) if bias else None
        d_rsqrt = d_token ** -0.5
        for p in (self.weight, self.bias):
            if p is not None:
                nn.init.uniform_(p, -d_rsqrt, d_rsqrt)

    def forward(self, x):
        x = self.weight[None] * x[..., None]
        if self.bias is not None:
            x = x + self.bias[None]
        return x


class CategoricalFeatureTokenizer(nn.Module):
    def __init__(self, cardinalities, d_token, bias=True):
        super().__init__()
        category_offsets = torch.tensor([0] + list(cardinalities[:-1])).cumsum(0)
        self.register_buffer('category_offsets', category_offsets, persistent=False)
        self.embeddings = nn.Embedding(sum(cardinalities), d_token)
        self.bias = nn.Parameter(torch.empty(len(cardinalities), d_token)) if bias else None
        d_rsqrt = d_token ** -0.5
        for p in (self.embeddings.weight, self.bias):
            if p is not None:
                nn.init.uniform_(p, -d_rsqrt, d_rsqrt)

    def forward(self, x):
        x = self.embeddings(x + self.category_offsets[None])
        if self.bias is not None:
            x = x + self.bias[None]
        return x


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num_features, cat_cardinalities, d_token):
        super().__init__()
        self.num_tokenizer = NumericalFeatureTokenizer(n_num_features, d_token)
        self.cat_tokenizer = CategoricalFeatureTokenizer(cat_cardinalities, d_token)

    def forward(self, x_num, x_cat):
        x = [self.num_tokenizer(x_num), self.cat_tokenizer(x_cat)]
        return torch.cat(x, dim=1)


class CLSToken(nn.Module):
    def __init__(self, d_token):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_token))
        d_rsqrt = d_token ** -0.5
        nn.init.uniform_(self.weight, -d_rsqrt, d_rsqrt)

    def expand(self, *leading_dimensions):
        if not leading_dimensions:
            return self.weight
        new_dims = (1,) * (len(leading_dimensions) - 1)
        return self.weight.view(*new_dims, -1).expand(*leading_dimensions, -1)

    def forward(self, x):
        return torch.cat([x, self.expand(len(x), 1)], dim=1)


class ReGLU(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * F.relu(b)


class MultiheadAttention(nn.Module):
    def __init__(self, d_token, n_heads, dropout, bias=True):
        super().__init__()
        self.W_q = nn.Linear(d_token, d_token, bias)
        self.W_k = nn.Linear(d_token, d_token, bias)
        self.W_v = nn.Linear(d_token, d_token, bias)
        self.W_out = nn.Linear(d_token, d_token, bias) if n_heads > 1 else None
        self.n_heads = n_heads
        self.dropout = nn.Dropout(dropout) if dropout else None

    def _reshape(self, x):
        batch_size, n_tokens, d = x.shape
        d_head = d // self.n_heads
        return (x.reshape(batch_size, n_tokens, self.n_heads, d_head)
                .transpose(1, 2)
                .reshape(batch_size * self.n_heads, n_tokens, d_head))

    def forward(self, x_q, x_kv):
        q, k, v = self.W_q(x_q), self.W_k(x_kv), self.W_v(x_kv)
        batch_size = len(q)
        d_head_key = k.shape[-1] // self.n_heads
        d_head_value = v.shape[-1] // self.n_heads
        n_q_tokens = q.shape[1]
        q = self._reshape(q)
        k = self._reshape(k)
        attention_logits = q @ k.transpose(1, 2) / math.sqrt(d_head_key)
        attention_probs = F.softmax(attention_logits, dim=-1)
        if self.dropout is not None:
            attention_probs = self.dropout(attention_probs)
        x = attention_probs @ self._reshape(v)
        x = (x.reshape(batch_size, self.n_heads, n_q_tokens, d_head_value)
             .transpose(1, 2)
             .reshape(batch_size, n_q_tokens, self.n_heads * d_head_value))
        if self.W_out is not None:
            x = self.W_out(x)
        return x


class Transformer(nn.Module):
    def __init__(self, d_token, n_blocks, attention_n_heads, attention_dropout, ffn_d_hidden,
                 ffn_dropout, residual_dropout, d_out):
        super().__init__()
        self.blocks = nn.ModuleList([])
        for layer_idx in range(n_blocks):
            layer = nn.ModuleDict({
                'attention': MultiheadAttention(d_token, attention_n_heads, attention_dropout),
                'ffn_linear_first': nn.Linear(d_token, ffn_d_hidden * 2),
                'ffn_activation': ReGLU(),
                'ffn_dropout': nn.Dropout(ffn_dropout),
                'ffn_linear_second': nn.Linear(ffn_d_hidden, d_token),
                'attention_residual_dropout': nn.Dropout(residual_dropout),
                'ffn_residual_dropout': nn.Dropout(residual_dropout),
                'output': nn.Identity(),
            })
            if layer_idx:  # prenormalization: the first block has no attention norm
                layer['attention_normalization'] = nn.LayerNorm(d_token)
            layer['ffn_normalization'] = nn.LayerNorm(d_token)
            self.blocks.append(layer)
        self.head = nn.ModuleDict({
            'normalization': nn.LayerNorm(d_token),
            'activation': nn.ReLU(),
            'linear': nn.Linear(d_token, d_out),
        })

    def _start_residual(self, layer, stage, x):
        x_residual = x
        norm_key = f'{stage}_normalization'
        if norm_key in layer:
            x_residual = layer[norm_key](x_residual)
        return x_residual

    def _end_residual(self, layer, stage, x, x_residual):
        x_residual = layer[f'{stage}_residual_dropout'](x_residual)
        return x + x_residual

    def forward(self, x):
        for layer in self.blocks:
            x_residual = self._start_residual(layer, 'attention', x)
            x_residual = layer['attention'](x_residual, x_residual)
            x = self._end_residual(layer, 'attention', x, x_residual)

            x_residual = self._start_residual(layer, 'ffn', x)
            x_residual = layer['ffn_linear_first'](x_residual)
            x_residual = layer['ffn_activation'](x_residual)
            x_residual = layer['ffn_dropout'](x_residual)
            x_residual = layer['ffn_linear_second'](x_residual)
            x = self._end_residual(layer, 'ffn', x, x_residual)
            x = layer['output'](x)
        x = x[:, -1]
        x = self.head['normalization'](x)
        x = self.head['activation'](x)
        return self.head['linear'](x)


class FTTransformer(nn.Module):
    def __init__(self, d_token=32):
        super().__init__()
        self.feature_tokenizer = FeatureTokenizer(N_NUM, CARDINALITIES, d_token)
        self.cls_token = CLSToken(d_token)
        self.transformer = Transformer(d_token, n_blocks=2, attention_n_heads=4, attention_dropout=0.2,
                                       ffn_d_hidden=int(d_token * 4 / 3), ffn_dropout=0.1, residual_dropout=0.1, d_out=CLASSES)

    def forward(self, x_num, x_cat, y):  # y: for loss_fn
        x = self.feature_tokenizer(x_num, x_cat)
        x = self.cls_token(x)
        return self.transformer(x)


def build_model():
    torch.manual_seed(0)
    return FTTransformer()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    x_cat = torch.stack([torch.randint(0, c, (BATCH,), generator=g) for c in CARDINALITIES], dim=1)
    return (torch.randn(BATCH, N_NUM, generator=g), x_cat, torch.randint(0, CLASSES, (BATCH,), generator=g))


def loss_fn(outputs, batch):
    return F.cross_entropy(outputs, batch[2])
