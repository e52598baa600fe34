"""ALBERT-style weight sharing: one block object in all three slots of the layer list. At
pp2 stage 0 holds layer 0 and stage 1 layers 1 and 2 (one module: outlined, each block
would hold its own copy of the weights); the weights are tied across the stages, their
gradients summed between them. The stages register those weights in different orders, and
the run aborted in gloo ("Received data size doesn't match expected size"): the tied
all-reduces now go by name."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Linear(8, d)
        block = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.layers = nn.ModuleList([block] * 3)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1)),)
