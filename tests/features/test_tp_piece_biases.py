"""A weight read in pieces, each piece with its own bias parameter (a fused qkv weight sliced
``F.linear(x, w[:d], q_bias)``, ``F.linear(x, w[d:2 * d])``, ``F.linear(x, w[2 * d:],
v_bias)``, as timm's Swin-V2 / BEiT attention keeps q and v biases and no k bias): every
piece's bias is sharded with its piece. The plan kept one bias per weight (the last read), so
``q_bias`` stayed replicated beside its sharded piece and the compile stopped with an
internal error ("the gradient of ...q_bias is Partial over tp ... no partial_tp entry").
Now both biases are column_parallel with their pieces and every tp rank of the program equals
the unmodified model (the compile's self-check: outputs, gradients, one SGD step).
"""
import re

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

D, H = 32, 4


class _SlicedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        w = self.qkv.weight
        qkv = torch.cat((F.linear(x, w[:D], self.q_bias), F.linear(x, w[D:2 * D]),
                         F.linear(x, w[2 * D:], self.v_bias)), -1)
        q, k, v = qkv.view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, D))


def test_each_piece_of_a_weight_shards_its_own_bias():
    torch.manual_seed(0)
    model = nn.Sequential(_SlicedQKV(), _SlicedQKV())
    batch = (torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(model, batch, Spec.model_validate({"mesh": {"tp": 2}}),
                                      reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    for i in (0, 1):
        for name in ("q_bias", "v_bias"):
            t = program.plan.tensors[f"{i}.{name}"]
            assert (t.tp_dim, t.role) == (0, "column_parallel"), t
        assert program.plan.tensors[f"{i}.qkv.weight"].tp_dim == 0
