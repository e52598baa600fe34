"""perceiver_resampler (external): a Flamingo-style perceiver resampler in plain PyTorch:
learned latents cross-attend to visual features of another width (``nn.MultiheadAttention``
with ``kdim``/``vdim``: q/k/v weights of their own, ``in_proj_bias.chunk(3)``), then a GELU
MLP; a classifier on the mean latent. Attention dropout 0.1.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, VIS, HEADS, LATENTS, LAYERS = 32, 24, 4, 6, 4


class ResamplerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_q, self.norm_kv = nn.LayerNorm(DIM), nn.LayerNorm(VIS)
        self.attn = nn.MultiheadAttention(DIM, HEADS, dropout=0.1, kdim=VIS, vdim=VIS,
                                          batch_first=True)
        self.norm_ff = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, lat, feats):
        kv = self.norm_kv(feats)
        lat = lat + self.attn(self.norm_q(lat), kv, kv, need_weights=False)[0]
        return lat + self.ff(self.norm_ff(lat))


class Resampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(LATENTS, DIM) * 0.02)
        self.layers = nn.ModuleList(ResamplerBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 10)

    def forward(self, feats, labels):  # labels: for loss_fn
        lat = self.latents.unsqueeze(0).expand(feats.shape[0], -1, -1)
        for layer in self.layers:
            lat = layer(lat, feats)
        return self.head(lat.mean(1))


def build_model():
    torch.manual_seed(0)
    return Resampler()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 12, VIS, generator=g), torch.randint(0, 10, (8,), generator=g))


def loss_fn(logits, batch):
    return F.cross_entropy(logits, batch[1])
