"""Blocks in an nn.Sequential (stem, four blocks, norm, head), as vision and research models
hold them."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), *(Block(32) for _ in range(4)), nn.LayerNorm(32),
                         nn.Linear(32, 4))


def example_inputs():
    return (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1)),)
