"""Sequence parallelism and in-place writes. A row_parallel output written in place through a
view along the sequence (``y = pr(h); y[:, 0].zero_()``: zero the first position) was a
sequence shard, and the write reached a copy made at the region's edge (a gathered value, a
local slice) instead of the tensor the stream reads: the compile stopped at its own
self-check, an internal error advising mesh.tp=1 (zoo 22 F3). A write whose writer, tensor,
views and readers are not all on one side of the region's edge now keeps them all out of it
(planning/sequence.py ``_split_writes``); a write inside the region (an in-place add to a
sequence shard) keeps it. The compile's self-check runs every tp rank against the model.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

D, V, T = 32, 64, 8


class _MLP(nn.Module):
    def __init__(self, write: str):
        super().__init__()
        self.fc, self.pr, self.write = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), write

    def forward(self, x):
        y = self.pr(F.gelu(self.fc(x)))
        if self.write == "first position":
            y[:, 0].zero_()
        else:  # every position, in the region
            y.mul_(0.5)
        return y


class _Model(nn.Module):
    def __init__(self, write: str):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_MLP(write) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.head(x)


@pytest.mark.parametrize("write", ["first position", "every position"])
def test_an_in_place_write_is_not_split_by_the_region_edge(write):
    torch.manual_seed(0)
    batch = (torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_Model(write), batch, Spec.model_validate(
        {"mesh": {"tp": 2}}), lambda out, b: F.cross_entropy(out.reshape(-1, V),
                                                             b[0].reshape(-1)), reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    held = re.search(r"sequence parallel: on \((\d+) values held as sequence shards of 1/2; "
                     r".*?(\d+) read\(s\) outside gathered", program.report)
    assert held, program.report
    if write == "every position":  # in the region: the stream stays sharded, nothing gathered
        assert held.group(2) == "0", held.group(0)
    else:  # the written output and its readers out of it, each block's pr gathered
        assert re.search(r"gathered from the sequence shards for readers outside: .*"
                         r"\(blocks\.0\.pr\), .*\(blocks\.1\.pr\)", program.report), program.report
