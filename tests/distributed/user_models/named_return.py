"""A forward returning a ``typing.NamedTuple`` with a list and a None field, as
infini-transformer-pytorch's ``TransformerReturn(logits, cached_kvs, past_memories)``
(plan/out_spec.py registers and resolves the class; the None leaf holds no output). Its loss
has shape (1,), as compressive-transformer-pytorch's with its (1,) auxiliary loss added:
--verify compares it with the reference's 0-dim loss (zoo 18: FAILed on the shape)."""
import typing

import torch
import torch.nn.functional as F
from torch import nn


class Return(typing.NamedTuple):
    logits: torch.Tensor
    cached: typing.Optional[list]
    memories: typing.Optional[torch.Tensor]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x, cached = self.emb(ids), []
        for layer in self.layers:
            x = x + layer(x)
            cached.append(x)
        return Return(self.head(x), cached, None)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1)),)


def loss_fn(outputs, batch):
    aux = outputs.logits.new_zeros(1)  # an auxiliary loss of shape (1,)
    return F.cross_entropy(outputs.logits[:, :-1].reshape(-1, 32), batch[0][:, 1:].reshape(-1)) + aux
