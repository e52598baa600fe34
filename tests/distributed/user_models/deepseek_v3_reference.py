"""The mixture-of-experts of DeepSeek-V3's reference code (deepseek-ai/DeepSeek-V3
``inference/model.py``: ``Gate``, ``Expert``, ``MoE``), not transformers, at toy size:
sigmoid scores with a correction bias, group-limited routing (4 routed experts in 2 groups,
the best group by its top-2 sum, top-2 experts inside it), weights renormalised over the
chosen, a shared expert beside the routed ones, the first layer dense. The routed experts are
an ``nn.ModuleList`` the layer loops over (``torch.where(indices == i)``, ``y[idx] += ...``),
so ``mesh.ep`` > 1 goes through the stack_experts pass. One change from the original: its
``if counts[i] == 0: continue`` (a Python branch on routed data, which no graph capture can
follow) is dropped; an expert without rows computes on zero rows instead."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, INTER, MOE_INTER, HEADS = 64, 32, 64, 24, 4
N_ROUTED, N_GROUPS, TOPK_GROUPS, TOPK, N_SHARED, N_DENSE, LAYERS = 4, 2, 1, 2, 1, 1, 3


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N_ROUTED, DIM) * DIM ** -0.5)
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, N_ROUTED))

    def forward(self, x):
        scores = F.linear(x, self.weight).sigmoid()
        original_scores = scores
        scores = scores + self.bias
        scores = scores.view(x.size(0), N_GROUPS, -1)
        group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(TOPK_GROUPS, dim=-1)[1]
        mask = scores.new_ones(x.size(0), N_GROUPS, dtype=bool).scatter_(1, indices, False)
        scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, TOPK, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True)
        return weights.type_as(x), indices


class Expert(nn.Module):
    def __init__(self, inter):
        super().__init__()
        self.w1 = nn.Linear(DIM, inter, bias=False)
        self.w2 = nn.Linear(inter, DIM, bias=False)
        self.w3 = nn.Linear(DIM, inter, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.experts = nn.ModuleList(Expert(MOE_INTER) for _ in range(N_ROUTED))
        self.shared_experts = Expert(N_SHARED * MOE_INTER)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, DIM)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        for i in range(N_ROUTED):
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wkv = nn.Linear(DIM, 2 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        k, v = self.wkv(x).chunk(2, dim=-1)
        q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in (self.wq(x), k, v))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.attn = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-6)
        self.ffn = Expert(INTER) if layer_id < N_DENSE else MoE()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(i) for i in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build_model():
    torch.manual_seed(0)
    return Transformer()


def _batch(seed: int):
    return (torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed)),)


def example_inputs():
    return _batch(1)


def loss_fn(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[0][:, 1:].reshape(-1))


def batches(n=100):
    for i in range(n):
        yield _batch(100 + i)
