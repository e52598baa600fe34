"""Blocks in the order the graph runs them, and only those it runs
(analysis/partition.py ``blocks_in_run_order``). A model running its ModuleList reversed
compiled at pp2 to an internal error (SplitMismatch), or with one more call of a block, to
every block on stage 0 with no word; a block forward never runs stopped every layout,
tp2 included, with an internal error (zoo 17 Z2, Z3)."""
import torch
import torch.nn as nn

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec

D = 32


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        self.layers, self.order = nn.ModuleList([_Block() for _ in range(4)]), order

    def forward(self, x):
        for i in self.order:
            x = self.layers[i](x)
        return x


def _compile(order, mesh):
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2}})
    batch = (torch.randn(4, 8, D, generator=torch.Generator().manual_seed(1)),)
    return compile_module(_Stack(order), batch, spec, reference=False)


def _stage_rows(report: str) -> list[str]:
    return [line.split("|")[2].strip() for line in report.splitlines()
            if line.startswith("| 0 |") or line.startswith("| 1 |")]


def _checked(program) -> None:
    assert [n for n in program.notes if n.startswith("self-check:")], program.notes


def test_a_reversed_module_list_is_staged_in_the_order_it_runs():
    program = _compile([3, 2, 1, 0], {"pp": 2})
    assert _stage_rows(program.report) == ["layers.3 .. layers.2", "layers.1 .. layers.0"]
    _checked(program)


def test_a_block_run_again_at_the_end_keeps_the_stages_balanced():
    program = _compile([3, 2, 1, 0, 0], {"pp": 2})  # 5 block runs: 3 | 2 either way
    assert _stage_rows(program.report) in (["layers.3 .. layers.2", "layers.1 .. layers.0"],
                                           ["layers.3 .. layers.1", "layers.0"])
    _checked(program)


def test_a_block_forward_never_runs_is_no_block_at_tp2_and_pp2():
    for mesh in ({"tp": 2}, {"pp": 2}):
        program = _compile([0, 1, 2], mesh)
        assert any("not used by forward" in w and "layers.3.up.weight" in w
                   for w in program.warnings), program.warnings
        _checked(program)
