"""ReZero-style blocks (Bachlechner et al. 2020): each residual branch scaled by a learned
0-dim gate, and a 0-dim temperature on the logits (CLIP's ``logit_scale``). FSDP2 refuses
to shard 0-dim parameters; at dp=2 under the default ZeRO-3 the run crashed before
("fully_shard doesn't support scalar parameters")."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.alpha * self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.stem = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.logit_scale.exp()


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1)),)
