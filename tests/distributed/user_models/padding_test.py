"""ESM-2's padding test (fair-esm ``esm2.py``: ``if not padding_mask.any(): padding_mask =
None``) in a small model: a branch on the token ids' values. ``batches()`` yields one batch
with padding, as the example, then one without."""
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class PaddingTest(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids):
        pad = ids.eq(0)
        x = self.emb(ids)
        if not pad.any():
            pad = None
        if pad is not None:
            x = x * (1 - pad.unsqueeze(-1).type_as(x))
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    torch.manual_seed(0)
    return PaddingTest()


def _ids(padded: bool):
    ids = torch.randint(1, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    if padded:
        ids[:, -3:] = 0
    return (ids,)


def example_inputs():
    return _ids(True)


def batches():
    yield _ids(True)
    yield _ids(False)
