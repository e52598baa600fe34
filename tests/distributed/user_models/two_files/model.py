"""A model.py that is one file of a project: its MLP comes from a module beside it
(``tf_mlp.py``) and its attention from a package below it (``tf_blocks/attention.py``), as
``python model.py`` would find them. The compile copies both to OUT/model_deps/."""
import torch
from torch import nn

from tf_blocks.attention import Attention
from tf_mlp import MLP


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)),)
