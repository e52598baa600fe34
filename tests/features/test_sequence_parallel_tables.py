"""Sequence parallelism and the tables a model computes or holds over positions.

- A value is a sequence shard only as (batch, seq, ...) or (batch * seq, ...): a table the
  model computes over positions, (2 seq - 1, features), with as many features as its fixed
  sequence length (x-transformers' DynamicPositionBias MLP, called by every block), was taken
  as (?, seq): its features were reduce-scattered, a bias cut, and the program failed the
  compile's rank check (internal error: "the program fails on a tp rank's shapes at
  gathered_linears"), or, under pp, the split check.
- A parameter entering the region by a local slice (a (seq, features) table every block
  adds to its stream) is sliced in each block that reads it: one slice at the root sent
  the later blocks' copy from the first stage, and the split check stopped the compile
  (SplitMismatch: "stage 1 ... lacks ['table']").
The compile's self-check runs every tp rank against the unmodified model (fp32).
"""
import re

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

D, H, V, T = 32, 4, 64, 8


class _PositionMLP(nn.Module):
    """A bias per head from relative distance, by an MLP over positions (T hidden)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, T), nn.SiLU(), nn.Linear(T, T), nn.SiLU(),
                                 nn.Linear(T, H))

    def forward(self, n):
        pos = self.mlp(torch.arange(-n + 1, n).float()[:, None])
        return pos[torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1].permute(2, 0, 1)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, bias=None, table=None):
        b, t, _ = x.shape
        x = x if table is None else x + table
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias(t))
        x = x + self.o(y.transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(x)))


class _Model(nn.Module):
    def __init__(self, shared: str):
        super().__init__()
        self.shared = shared
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.rel = _PositionMLP()
        self.table = nn.Parameter(torch.randn(T, D) * 0.1)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(T))  # the model fixes the length at T
        for b in self.blocks:
            x = b(x, bias=self.rel) if self.shared == "bias" else b(x, table=self.table)
        return self.head(x)


def _compile(shared: str, **mesh):
    torch.manual_seed(0)
    model = _Model(shared)
    batch = (torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2}})
    return compiler.compile_module(model, batch, spec, lambda out, b: F.cross_entropy(
        out[:, :-1].reshape(-1, V), b[0][:, 1:].reshape(-1)), reference=False)


def _checked(program) -> None:
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note


def test_a_table_over_positions_is_no_sequence_shard():
    program = _compile("bias", tp=2)
    _checked(program)
    sp = [line for line in program.report.splitlines() if "sequence-parallel region" in line]
    assert not any("rel." in line for line in sp), sp
    assert program.plan.tensors["rel.mlp.2.weight"].tp_dim is not None  # still tp-sharded


def test_a_parameter_every_block_adds_is_sliced_in_each_block():
    program = _compile("table", tp=2, pp=2)
    _checked(program)
    assert re.search(r"enters the sequence-parallel region by a local slice: .*\btable\b",
                     program.report), program.report
    assert program.plan.tensors["table"].stages == (0, 1)
