"""Values nothing reads, and the gradients of the parameters only they read.

transformers' LiLT updates its layout stream in every layer, but the model returns the text
stream only: the last layer's layout update is dead, and eager PyTorch leaves its parameters'
gradients None. The captured graph kept it; the sequence-parallel pass fused its linear with
the live one beside it (one all-gather, one autograd Function), whose backward gave the dead
linear a zero gradient: `--verify` FAIL at tp2, tp4 and tp2 x pp2 (a held-out zoo), and an
optimizer with weight decay or momentum would have moved weights the model's leaves alone.
Capture now drops dead code (random draws and writes in place stay); a dead branch kept
alive by a random draw (LiLT's dropout after its layout output) leaves the fused Function's
output without a cotangent, and the Function gives its linear none; and the compile's
numerics self-check refuses a gradient where the model's is None.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.emit import numerics_check, numerics_compare
from parallelizer.errors import PlanError
from parallelizer.frontend import capture
from parallelizer.frontend.spec import Spec

D = 32


class TwoStreams(nn.Module):
    """Two blocks each reading both streams and updating both; only ``x`` is returned."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm": nn.LayerNorm(D), "lin_a": nn.Linear(D, 2 * D), "out_x": nn.Linear(2 * D, D),
            "lin_b": nn.Linear(D, 2 * D), "out_y": nn.Linear(2 * D, D)}) for _ in range(2))

    def forward(self, x):
        y = torch.zeros_like(x)
        for b in self.blocks:
            h = b["norm"](x + y)
            x, y = (x + b["out_x"](F.gelu(b["lin_a"](h))),
                    y + b["out_y"](F.gelu(b["lin_b"](h))))
        return x


def _compile():
    torch.manual_seed(0)
    batch = (torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1)),)
    return compiler.compile_module(TwoStreams(), batch, Spec.model_validate({"mesh": {"tp": 2}}),
                                   reference=False)


@pytest.fixture(scope="module")
def program():
    return _compile()


def test_a_dead_stream_is_dropped_and_its_parameters_get_no_gradient(program):
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program", note), note
    dead = {f"blocks.1.{m}.{p}" for m in ("lin_b", "out_y") for p in ("weight", "bias")}
    assert not dead & set(program.plan.tensors), "held by no stage: no gradient, as in eager"
    assert "blocks.0.lin_b.weight" in program.plan.tensors


def test_a_dead_output_of_the_fused_linears_gives_no_gradient(monkeypatch):
    """Dead code kept (as a random draw on it keeps it): the self-check, which compares
    gradients present with gradients present, passes."""
    monkeypatch.setattr(capture, "_drop_dead_code", lambda gm: None)
    program = _compile()
    assert "blocks.1.lin_b.weight" in program.plan.tensors
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes


def test_the_self_check_refuses_a_gradient_the_model_leaves_none(program):
    fqn = "blocks.0.lin_b.weight"
    want = numerics_check.Reference(outputs=[], cotangents=[], grads={fqn: None}, buffers={})
    tensor = program.plan.tensors[fqn]
    piece = numerics_compare.local_piece(torch.zeros(tensor.shape), tensor, 2, 0)  # rank 0's
    with pytest.raises(PlanError, match=r"differs first at the gradient of blocks\.0\.lin_b\."
                                        r"weight: the program computes one where the model's is "
                                        r"None"):
        numerics_compare.compare_grads(program.plan, [{fqn: piece}, {fqn: None}], want, 2, [0.0])
