"""Blocks that forward runs more than once, interleaved (labml-nn's HyperLSTM calls each
cell of its ModuleList once per time step): stages are cut where forward first enters a
block, so every later call of cell 0 ran on stage 1, 6 % / 94 % of the FLOPs, reported as
the balanced split without a word (zoo 19 Y3). The compile now warns with the figures and
the cause (planning/pipeline_summary.repeated_calls_warning); blocks run once do not."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

V, D, T = 32, 16, 6


class _Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.ih, self.hh = nn.Linear(D, 4 * D), nn.Linear(D, 4 * D)

    def forward(self, x, h, c):
        i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class _StackedLSTM(nn.Module):
    def __init__(self, loop_outside: bool):
        super().__init__()
        self.loop_outside = loop_outside
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.cells = nn.ModuleList(_Cell() for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        zero = x.new_zeros(x.shape[0], D)
        if self.loop_outside:  # each time step through every cell: the cells interleave
            state = [(zero, zero) for _ in self.cells]
            out = []
            for t in range(T):
                h = x[:, t]
                for j, cell in enumerate(self.cells):
                    state[j] = cell(h, *state[j])
                    h = state[j][0]
                out.append(h)
            return self.head(torch.stack(out, 1))
        for cell in self.cells:  # each cell over every time step: one block after the other
            h = c = zero
            out = []
            for t in range(T):
                h, c = cell(x[:, t], h, c)
                out.append(h)
            x = torch.stack(out, 1)
        return self.head(x)


def _warnings(loop_outside: bool) -> list[str]:
    torch.manual_seed(0)
    batch = (torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    loss = lambda out, b: F.cross_entropy(out.reshape(-1, V), b[0].reshape(-1))  # noqa: E731
    program = compiler.compile_module(_StackedLSTM(loop_outside), batch, spec, loss,
                                      reference=False)
    return [w for w in program.warnings if "unbalanced" in w]


def test_cells_called_per_time_step_warn_of_the_unbalanced_stages():
    (warning,) = _warnings(loop_outside=True)
    assert "forward runs cells.0 (6 times), cells.1 (6 times) with the same weights" in warning
    assert "max / mean stage FLOPs 1." in warning and "use mesh.pp=1" in warning


def test_cells_run_one_after_the_other_split_without_a_warning():
    assert _warnings(loop_outside=False) == []
