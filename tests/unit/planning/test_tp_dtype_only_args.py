"""Performer's softmax kernel (performer-pytorch, FAVOR+): the random-feature projection, a
replicated buffer, is expanded over the heads and cast with ``.type_as(k)``, k the rank's
heads. The compile's gradient check took ``type_as``'s output to vary over the tp ranks
because ``k`` does, though only its dtype is read: the einsum after it became sharded
compute, the all-gathered k before it got a Partial gradient, and the compile stopped with
an internal error ("the gradient of ...k.weight is Mixed over tp", zoo 12 F20; the
planner's own placements were right). The program forward now reads the inputs an op
reads values from (``gradient_forward.value_inputs``), as the backward did already."""
import re

import torch
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec


class _FavorKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.k, self.o = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.register_buffer("proj", torch.randn(16, 16))

    def forward(self, x):
        b, n, _ = x.shape
        k = self.k(x).view(b, n, 4, 16).transpose(1, 2)
        proj = self.proj[None, None].expand(b, 4, 16, 16).type_as(k)
        kd = torch.einsum("...id,...jd->...ij", k * 0.5, proj)
        k = torch.exp(kd - (k ** 2).sum(-1, keepdim=True) / 2
                      - torch.amax(kd, dim=(-1, -2), keepdim=True).detach()) + 1e-4
        return x + self.o(k.transpose(1, 2).reshape(b, n, 64))


def test_a_dtype_only_argument_does_not_make_its_op_sharded_compute():
    torch.manual_seed(0)
    batch = (torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(nn.Sequential(_FavorKeys(), _FavorKeys()), batch,
                                      Spec.model_validate({"mesh": {"tp": 2}}),
                                      lambda out, b: out.square().mean())
    assert program.plan.tensors["1.k.weight"].role == "column_parallel"
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
