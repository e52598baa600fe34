"""A small MLP whose data holds an Inf at the third batch (a corrupt sample): the loss of
step 3 is NaN and so is every gradient; run.py must stop there (test_stops.py)."""
import torch
from torch import nn

BAD_STEP = 3


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(torch.relu(self.norm(x)))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), *(Block(16) for _ in range(2)), nn.Linear(16, 4))


def example_inputs():
    return (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1)),)


def batches():
    for i in range(100):
        x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(100 + i))
        if i + 1 == BAD_STEP:
            x[0, 0, 0] = float("inf")
        yield (x,)
