"""An input without the batch dim: diffusers' Flux takes its per-position ``img_ids`` /
``txt_ids`` as ``(S, 3)`` beside ``hidden_states (B, S, D)`` (zoo 13 Z9).

The rank check built every input with the first input's batch at dim 0 and the run's dp
slice cut every input to it: an internal error at tp2 and tp1 alike ("the program fails on a
tp rank's shapes"), and the compile warned that the ids fixed the batch and the sequence
(export's guard ``x.size(1) == ids.size(0)`` ties the two symbols, it fixes neither). Where
nothing splits the batch such an input is kept whole; where mesh.dp or microbatches split it,
the compile refuses naming the input (nothing written)."""
from __future__ import annotations

import pytest
import torch

from parallelizer.cli import parallelize as cli
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.runtime.batching import dp_slice

MODEL_PY = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Attn(nn.Module):
    def __init__(self, d=64, h=4):
        super().__init__()
        self.h, self.dh = h, d // h
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        half = self.dh // 2
        rot = lambda t: t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin
        a = F.scaled_dot_product_attention(rot(q), rot(k), v)
        return x + self.out(a.transpose(1, 2).reshape(b, n, d))

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attn(), Attn()])
        self.register_buffer("inv", 1.0 / 100 ** (torch.arange(0, 16, 2).float() / 16))

    def forward(self, x, ids):  # x (B, S, 64); ids (S, 3): no batch dim
        f = ids.sum(-1)[:, None] * self.inv
        f = torch.cat([f, f], -1)
        cos, sin = f.cos()[None, None], f.sin()[None, None]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return x

def build_model():
    torch.manual_seed(0)
    return M()

def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(4, 16, 64, generator=g), "ids": torch.rand(16, 3, generator=g) * 4}
'''


def _cli(tmp_path, capsys, spec: str):
    (tmp_path / "model.py").write_text(MODEL_PY)
    (tmp_path / "spec.yaml").write_text(spec)
    out = tmp_path / "out"
    code = cli.main([str(tmp_path / "model.py"), str(tmp_path / "spec.yaml"), "-o", str(out)])
    return code, capsys.readouterr(), out


def test_an_input_without_the_batch_dim_is_kept_whole_at_tp2(tmp_path, capsys):
    code, io, out = _cli(tmp_path, capsys, "mesh: {tp: 2}\n")
    assert code == 0, io.err
    assert "self-check: 2 tp rank(s) of the program against the model" in io.out, io.out
    assert "fixes the" not in io.out + io.err, io  # a tie between two inputs fixes nothing
    assert "tensor parallel: 4 of 4 weight matrices in blocks sharded" in io.out, io.out
    # what run.py feeds the program: the whole ids beside the rank's share of x
    plan = ParallelPlan.from_json((out / "plan.json").read_text())
    batch = {"x": torch.randn(4, 16, 64), "ids": torch.rand(16, 3)}
    got = dp_slice(plan, batch, 0, "cpu")
    assert torch.equal(got["x"], batch["x"]) and torch.equal(got["ids"], batch["ids"])


@pytest.mark.parametrize("spec", ["mesh: {pp: 2}\npipeline: {microbatches: 2}\n",
                                  "mesh: {dp: 2}\n"])
def test_a_split_of_an_input_without_the_batch_dim_is_refused(tmp_path, capsys, spec):
    code, io, out = _cli(tmp_path, capsys, spec)
    assert code == 2 and not out.exists(), io
    assert io.err.startswith("error: example_inputs()'s key 'ids' (16, 3) has 16 at dim 0 "
                             "where key 'x' has the batch (4): mesh.dp"), io.err
    assert "splits every input along dim 0" in io.err and "t.expand(4, *t.shape)" in io.err
