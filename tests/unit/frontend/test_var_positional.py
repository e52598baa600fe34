"""A wrapper whose ``forward(self, *args, **kwargs)`` passes the batch on (keras 3's torch
backend, peft- and accelerate-style wrappers; zoo 18 Z4). torch 2.13's export wants the
dynamic shapes of ``*args`` as one tuple: given one dict per input, every capture with a
symbolic batch failed, the capture fell back to static sizes, the compile warned that "the
model's code fixes the batch size" (tp2) and refused pp2 with that advice, though the code
fixes nothing. Each positional input now gets a name of its own while exporting (``args_0``,
as export names it): the batch and sequence are symbols, pp2 compiles."""
from pathlib import Path

import torch
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                    for _ in range(2))

    def forward(self, x, scale):
        for block in self.blocks:
            x = x + block(x) * scale
        return x


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Net()

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _batch(b, t, g):
    return (torch.randn(b, t, 8, generator=g), torch.randn(b, t, 8, generator=g))


def test_inputs_taken_through_var_positional_are_captured_dynamic():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = _Wrapper()
    cap = capture(model, _batch(2, 5, g), Path(__file__))
    assert cap.route == "torch.export" and cap.input_names == ("args_0", "args_1")
    assert "forward" not in vars(model)
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":  # batch and sequence symbols (the example's 2 and 5 before)
            assert [type(s) for s in n.meta["val"].shape[:2]] == [torch.SymInt] * 2, n.meta["val"]
    x, scale = _batch(3, 7, g)
    with torch.no_grad():
        (got,) = cap.gm(x, scale)
        torch.testing.assert_close(got, model(x, scale), rtol=0, atol=0)


def test_a_var_positional_wrapper_compiles_under_pp():
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    program = compiler.compile_module(_Wrapper(), _batch(4, 5, torch.Generator().manual_seed(0)),
                                      spec, reference=False)
    assert not [w for w in program.warnings if "fixes the batch size" in w], program.warnings
    assert len(program.plan.stages) == 2
