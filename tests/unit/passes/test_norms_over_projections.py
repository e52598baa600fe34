"""A LayerNorm or RMSNorm over a linear's whole output (NormFormer's FFN norm) ended the seed
walk as a block's input norm does: ``fc1 -> LayerNorm(FF) -> fc2`` was refused at tp2 ("no
linear layer feeds another"), NormFormer blocks kept their MLPs whole (8 of 12 matrices, a
held-out zoo), and a pair reaching ``nn.RMSNorm`` all-gathered its features. At mesh.tp > 1
the pass writes such a norm as the means it computes (passes/norms_over_projections.py):
fc1 column, fc2 row, the means all-reduced, and the compile's self-check (every tp rank
against the unmodified model) passes. A block's input norm over the residual stream is left
as it is, and so is every norm at tp = 1."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelizer.analysis.graph_facts import aten
from parallelizer.passes.norms_over_projections import apply_norms_over_projections
from tp_small_models import captured

_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.mid = NORM

    def forward(self, x):
        return x + self.fc2(self.mid(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1)),)
'''


@pytest.mark.parametrize("norm", ["nn.LayerNorm(64)", "nn.RMSNorm(64)"])
def test_a_norm_between_the_linears_of_a_pair_is_sharded_and_checked(tmp_path, capsys, norm):
    from parallelizer.cli import parallelize as cli
    (tmp_path / "model.py").write_text(_MODEL.replace("NORM", norm))
    (tmp_path / "spec.yaml").write_text("mesh: {tp: 2}\n")
    code = cli.main([str(tmp_path / "model.py"), str(tmp_path / "spec.yaml"), "-o",
                     str(tmp_path / "out")])
    io = capsys.readouterr()
    assert code == 0, io.err
    assert "tensor parallel: 4 of 4 weight matrices in blocks sharded" in io.out, io.out
    assert "self-check: 2 tp rank(s) of the program against the model" in io.out, io.out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "all-reduce (avg) of a Partial output of mean" in report
    assert "all-gather (Shard" not in report  # the features are never gathered


class PreNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def test_a_norm_over_the_residual_stream_is_left_as_it_is():
    gm = captured(PreNorm(), (torch.randn(2, 4, 32),)).gm
    assert apply_norms_over_projections(gm) == 0
    assert any(n.target is aten.layer_norm.default for n in gm.graph.nodes)


class MaskedLMHead(nn.Module):
    """BERT's MLM transform, ``dense -> gelu -> LayerNorm -> decoder``, the decoder tied to
    the embedding, or untied and of another width than the table (RemBERT's): written out,
    the norm let the walk pair ``dense`` with the decoder as its row, and the vocab_parallel
    head became a row linear all-reducing whole logits (a sweep of 330 models caught it on
    eight masked LMs)."""

    def __init__(self, tied):
        super().__init__()
        self.emb, self.up = nn.Embedding(50, 16), nn.Linear(16, 32)
        self.dense, self.ln = nn.Linear(32, 32), nn.LayerNorm(32)
        self.decoder = nn.Linear(32, 50)
        if tied:
            self.emb = nn.Embedding(50, 32)
            self.decoder.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        x = x if x.shape[-1] == 32 else self.up(x)
        return self.decoder(self.ln(torch.nn.functional.gelu(self.dense(x))))


@pytest.mark.parametrize("tied", [True, False])
def test_a_norm_feeding_an_lm_head_is_left_as_it_is(tied):
    gm = captured(MaskedLMHead(tied), (torch.randint(0, 50, (2, 4)),)).gm
    assert apply_norms_over_projections(gm) == 0
