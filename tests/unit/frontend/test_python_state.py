"""A Python number the forward changes on every call is refused at capture
(frontend/python_state.py, decision 209): the program would keep the captured call's value."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from parallelizer.errors import CaptureError
from parallelizer.frontend.capture import capture


class WarmedBlock(nn.Module):
    """A residual warmed up by a call counter (zoo 20 Z3); ``kind`` says how it is held."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.kind = kind
        if kind == "buffer":
            self.register_buffer("calls", torch.zeros(()))
        else:
            self.calls = 0
        self.seen_len = 0

    def forward(self, x):
        self.seen_len = max(self.seen_len, x.shape[1])  # a cache's length: changes once
        if self.kind == "buffer":
            warm = ((self.calls + 1) / 4).clamp(max=1.0)
            self.calls.add_(1)
            return x + warm * self.fc(x)
        warm = min(1.0, (self.calls + 1) / 4)
        self.calls += 1  # the line the refusal names
        return x + (warm if self.kind == "read" else 1.0) * self.fc(x)


LINE = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
            if "the line the refusal names" in text)


def _capture(kind: str, device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(WarmedBlock(kind), WarmedBlock(kind)).to(device)
    return model, capture(model, (torch.randn(2, 3, 8, device=device),), Path(__file__))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_counter_the_output_reads_is_refused_naming_it_and_its_line(device):
    with pytest.raises(CaptureError) as e:
        _capture("read", device)
    msg = str(e.value)
    assert "changes 0.calls (a Python int) on every call of forward (0 -> 1 -> 2, at " \
        f"test_python_state.py:{LINE})" in msg, msg
    assert ("output changes with it" if device == "cpu" else "cannot tell") in msg, msg
    assert "register_buffer('calls'" in msg and "Also changing on every call: 1.calls" in msg


def test_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(WarmedBlock("read"))
    with pytest.raises(CaptureError):
        capture(model, (torch.randn(2, 3, 8),), Path(__file__))
    assert model[0].calls == 0 and model[0].seen_len == 0


@pytest.mark.parametrize("kind", ["buffer", "unread"])
def test_a_counter_in_a_buffer_or_one_no_output_reads_is_captured(kind):
    """The fix the refusal gives (a buffer written in place: the program writes it every
    step), and a counter the output does not depend on (logging)."""
    model, captured = _capture(kind)
    x, want = torch.randn(2, 3, 8), copy.deepcopy(model)  # gm may share the buffers it writes
    for _ in range(3):
        torch.testing.assert_close(captured.gm(x)[0], want(x), rtol=0, atol=0)
