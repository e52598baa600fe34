"""A forward that draws from Python's or NumPy's random generator (frontend/python_rng.py).

x-transformers' layer dropout (``if self.training and random() < layer_dropout: continue``,
``from random import random``) skipped some blocks in the one forward capture runs: the
pipeline split then failed with an internal error (``SplitMismatch``), and a capture that
happened to skip none would have compiled a program that never drops a layer (zoo 13 Z10).
Such a draw is now a CaptureError naming the line that drew, and the generators are left as
they were."""
from __future__ import annotations

import random
from pathlib import Path
from random import random as bound_random  # bound before capture, as x-transformers does

import numpy as np
import pytest
import torch
from beartype import beartype
from torch import nn

from parallelizer.errors import CaptureError
from parallelizer.frontend.capture import capture


class LayerDrop(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.draw = draw

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.draw() < 0.3:
                continue
            x = x + layer(x)
        return x


def _batch():
    return (torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("draw", [bound_random, lambda: random.randint(0, 9) / 10,
                                  lambda: np.random.rand()],
                         ids=["from-random-import", "randint", "numpy"])
def test_a_draw_in_forward_is_refused_naming_its_line(draw):
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(1)
    before = random.getstate(), np.random.get_state()[1].copy()
    with pytest.raises(CaptureError) as e:
        capture(LayerDrop(draw), _batch(), Path("model.py"))
    msg = str(e.value)
    assert "draws from Python's random module (or NumPy's) in forward at " \
           f"{__file__}:" in msg, msg
    assert "would be frozen into the program" in msg and "Fix: set the option" in msg, msg
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all()


def test_a_model_that_draws_only_when_not_training_is_captured():
    model = LayerDrop(bound_random).eval()
    before = random.getstate()
    captured = capture(model, _batch(), Path("model.py"))
    assert sum(n.target is torch.ops.aten.linear.default for n in captured.gm.graph.nodes) == 4
    assert random.getstate() == before



class _Checked(nn.Module):
    """A forward checked by beartype, with a ``list[...]`` argument (block-recurrent-
    transformer's ``xl_memories``)."""

    def __init__(self, own_draw: bool):
        super().__init__()
        self.fc, self.own_draw = nn.Linear(8, 8), own_draw

    @beartype
    def forward(self, x: torch.Tensor, extras: list[torch.Tensor] = []):
        if self.own_draw and random.random() < 0.0:
            x = x * 2
        return x + self.fc(x)


def test_a_type_checkers_draw_is_not_the_models():
    """beartype's wrapper draws (``getrandbits``) to pick the one item of a ``List[...]``
    argument it checks; that draw reaches no tensor, yet the model was refused at
    ``<@beartype(...) at 0x...>:13`` with advice about layer dropout
    (block-recurrent-transformer, zoo 16 Z4). It is captured now and the generators are
    left as they were; a draw of the model's own beside it is still refused at its line."""
    torch.manual_seed(0)
    random.seed(1)
    before = random.getstate()
    _Checked(False)(*_batch())
    assert random.getstate() != before, "beartype no longer draws: this test checks nothing"
    random.setstate(before)
    cap = capture(_Checked(False), _batch(), Path("model.py"))
    assert any(n.op == "call_function" for n in cap.gm.graph.nodes)
    assert random.getstate() == before
    with pytest.raises(CaptureError, match=f"in forward at {__file__}:"):
        capture(_Checked(True), _batch(), Path("model.py"))
