"""A Switch-Transformer-style MoE (Fedus et al. 2021) written by hand, not transformers:
the tokens mixed by a causal depthwise ``Conv1d`` (ConvMixer / Hyena-style, no attention:
tensor parallelism has no sharded rule for a conv over channels), and top-1 experts as an
``nn.ModuleList`` of non-gated GELU MLPs (wi, wo), routed by argmax, scaled by the router
probability, dispatched by boolean masks ``y[mask] = expert(x[mask])``. At tp2 only the
experts split (along their FFN dim)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, FF, EXPERTS, KERNEL = 64, 32, 64, 4, 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(DIM, FF, bias=False)
        self.wo = nn.Linear(FF, DIM, bias=False)

    def forward(self, x):
        return self.wo(F.gelu(self.wi(x)))


class Switch(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(EXPERTS))

    def forward(self, h):
        b, t, d = h.shape
        x = h.reshape(-1, d)
        p, idx = F.softmax(self.router(x), dim=-1).max(dim=-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = idx == i
            y[mask] = expert(x[mask])
        return (y * p.unsqueeze(-1)).view(b, t, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.mix = nn.Conv1d(DIM, DIM, KERNEL, groups=DIM, padding=KERNEL - 1)
        self.ln2 = nn.LayerNorm(DIM)
        self.moe = Switch()

    def forward(self, x):
        t = x.shape[1]
        x = x + self.mix(self.ln1(x).transpose(1, 2))[..., :t].transpose(1, 2)
        return x + self.moe(self.ln2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(1)),)


def loss_fn(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[0][:, 1:].reshape(-1))
