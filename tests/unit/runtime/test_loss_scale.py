"""runtime/loss_scale.py: the fp16 dynamic loss scale (halved and the step skipped on an
overflow, doubled after GROWTH_INTERVAL finite steps, its state round trip), and off
(scale 1, nothing skipped) under fp32 / bf16."""
from types import SimpleNamespace

import torch

from parallelizer.runtime import loss_scale
from parallelizer.runtime.loss_scale import LossScaler


class _Grads:
    """What LossScaler.unscale_ calls: GradNorm.scale_ over real tensors."""

    def __init__(self):
        self.g = torch.full((3,), 8.0)

    def scale_(self, factor):
        self.g.mul_(factor)


def test_fp16_scale_halves_on_overflow_and_grows_back(capsys):
    s = LossScaler("fp16")
    assert s.scale == loss_scale.INIT_SCALE
    grads = _Grads()
    s.unscale_(grads)
    assert torch.equal(grads.g, torch.full((3,), 8.0 / loss_scale.INIT_SCALE))
    ctx = SimpleNamespace(rank=0)
    assert s.skip_step(5, ctx) and s.scale == loss_scale.INIT_SCALE / 2
    assert "step 5 overflowed in fp16; skipped, scale now 32768" in capsys.readouterr().out
    for _ in range(loss_scale.GROWTH_INTERVAL):
        s.update()
    assert s.scale == loss_scale.INIT_SCALE and s.good_steps == 0
    s.update()
    state = s.state()
    again = LossScaler("fp16")
    again.load(state)
    assert (again.scale, again.good_steps) == (s.scale, 1)
    s.scale = loss_scale.MIN_SCALE
    assert not s.skip_step(6, ctx)  # cannot go lower: the non-finite value is real


def test_off_under_fp32_and_bf16():
    for dtype in ("fp32", "bf16"):
        s = LossScaler(dtype)
        grads = _Grads()
        s.unscale_(grads)
        assert s.scale == 1.0 and torch.equal(grads.g, torch.full((3,), 8.0))
        assert not s.skip_step(1, SimpleNamespace(rank=0)) and s.state() is None
