"""A relative-position bias table with one column per head, indexed by buckets computed from
the inputs and holding more rows than the vocabulary, in a model whose vocabulary no LM head
names (CPM-Ant's ``relative_attention_bias``,
1536 rows against 1120 tokens): the vocabulary planner took it for the vocabulary and
sharded its rows while tensor parallelism sharded its heads; the compile's gradient check
stopped with an internal error ("the gradient of cpmant.position_bias.relative_attention_bias
is Mixed over tp") at tp 2 and 4 (sweep rerun of 2026-12-07). A table tp shards per head is
no vocabulary (planning/vocab.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

V, D, H, T, BUCKETS = 48, 32, 4, 8, 128


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                          .transpose(1, 2).reshape(b, s, D))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, 2)  # an encoder: no LM head
        self.table = nn.Parameter(torch.randn(BUCKETS, H) * 0.1)  # more rows than V
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, ids):
        pos = ids.ne(0).long().cumsum(1)  # positions of the tokens: computed from the inputs
        bucket = (pos[:, None, :] - pos[:, :, None]).clamp(-60, 60) + 64
        bias = F.embedding(bucket, self.table).permute(0, 3, 1, 2)
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, bias)
        return self.head(x)


def test_a_per_head_table_larger_than_the_vocabulary_is_no_vocabulary():
    torch.manual_seed(0)
    batch = (torch.randint(1, V, (4, T), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    program = compiler.compile_module(_Model(), batch, spec, lambda out, b: F.cross_entropy(
        out.reshape(-1, 2), b[0].reshape(-1) % 2))
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert note.startswith("self-check: 2 tp rank(s) of the program against the model"), note
    assert "vocab_parallel: emb.weight Shard(0) over tp" in program.report
    assert "vocab_parallel: table" not in program.report
    assert program.plan.tensors["table"].tp_dim == 1  # its heads, with the attention's
