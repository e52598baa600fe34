"""A module cast in forward that changes nothing (frontend/module_state.unchanging_to_kept).

transformers' SwitchTransformers router runs ``self.classifier =
self.classifier.to(self.dtype)`` in forward, a no-op in fp32. Under torch.export
``Module._apply`` tries to swap each parameter for a fake copy and fails ("_apply():
Couldn't swap Linear.weight"): the whole model was refused at that line (zoo 14 F5). Such a
cast now returns the module as it is while capture runs; the model's ``to`` is torch's again
after it."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallelizer.frontend.capture import capture


class CastsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.classifier = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        self.fc1.to("cpu", dtype=torch.float32)
        return self.classifier(torch.relu(self.fc1(x.to(self.fc1.weight.dtype))))


def test_a_cast_that_changes_nothing_is_captured_as_the_module():
    torch.manual_seed(0)
    model = CastsInForward()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    captured = capture(model, (x,), Path("model.py"))
    # the first route: the symbolic_trace one ran the cast eagerly while tracing, and it fails
    # on other code of the same model (SwitchTransformers' expert loop)
    assert captured.route == "torch.export"
    gm = captured.gm
    assert sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes) == 2
    out = gm(x)
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, model(x))
    assert nn.Module.to.__qualname__ == "Module.to"
    assert model.half().classifier.weight.dtype == torch.float16  # torch's own cast again
