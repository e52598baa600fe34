"""A weight penalty computed in forward from the blocks' own weights, read by the root
after each block (``b.fc.weight.pow(2).sum()``). Under the default ZeRO-3, FSDP2 freed the
block's gathered parameters after its forward, the root read the freed memory and every
rank died with SIGSEGV (zoo 21 F4); the block now stays gathered until its backward."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.pr = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.pr(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Linear(6, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 6)

    def forward(self, x):
        h, penalty = self.stem(x), 0.0
        for block in self.blocks:
            h = block(h)
            penalty = penalty + block.fc.weight.pow(2).sum()
        return self.head(h).pow(2).mean() + 1e-3 * penalty


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1)),)
