"""Ops that mix a batch's samples (analysis/batch_mixing.py), named by the compile's warning
that the loss is not a mean over samples: a model centring its activations over the batch
(``h - h.mean(0)``) was warned of with a list of likely causes (a router's auxiliary loss,
BatchNorm) that named neither the op nor its line (zoo 22 F6)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.analysis.batch_mixing import batch_mixing
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec


class _Centred(nn.Module):
    def __init__(self, norm: bool = False):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.BatchNorm1d(16) if norm else None

    def forward(self, x):
        h = self.fc(x)
        h = h - h.mean(0, keepdim=True)  # over the batch
        h = h - h.mean(-1, keepdim=True)  # over the features: each sample alone
        if self.norm is not None:
            h = self.norm(h)
        return self.out(h)


def _batch():
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),)


def test_reductions_over_the_batch_and_batch_norm_are_found_with_their_lines():
    gm = capture(_Centred(norm=True), _batch(), None).gm
    found = batch_mixing(gm.graph)
    assert len(found) == 2, found
    assert re.fullmatch(r"aten\.mean\.dim \(mean\) at test_batch_mixing\.py:\d+", found[0])
    assert found[1].startswith("aten.batch_norm.default"), found
    assert batch_mixing(capture(_Centred(), _batch(), None).gm.graph) == found[:1]


def test_the_compile_warning_names_the_op_mixing_the_samples():
    torch.manual_seed(0)
    program = compiler.compile_module(_Centred(), _batch(), Spec.model_validate(
        {"mesh": {"dp": 2}}), lambda out, b: F.mse_loss(out, torch.zeros_like(out)))
    (warning,) = [w for w in program.warnings if "not a mean over samples" in w]
    assert re.search(r"The model's forward mixes the samples of a batch at aten\.mean\.dim "
                     r"\(mean\) at test_batch_mixing\.py:\d+: each chunk computes that over "
                     r"its own rows", warning), warning


class _Normalized(nn.Module):
    """F.normalize over the features (each sample alone) and a vector norm over the batch:
    a vector norm's second argument is its order, which was read as its dims ("'float'
    object is not iterable" in the compile of a CLIP-style model at dp2, zoo 25 F10)."""

    def forward(self, x):
        z = F.normalize(x, dim=-1)
        return z / torch.linalg.vector_norm(z, 2.0, dim=0, keepdim=True)


def test_a_vector_norm_reads_its_dims_not_its_order():
    found = batch_mixing(capture(_Normalized(), _batch(), None).gm.graph)
    assert len(found) == 1 and found[0].startswith("aten.linalg_vector_norm.default"), found
    assert re.search(r"at test_batch_mixing\.py:\d+$", found[0]), found
