"""A registered parameter the blocks read through a plain attribute (``self.table =
[table]``): non-strict torch.export swaps parameters by module path only, so it lifted the
read as a constant (``blocks.0.lifted_tensor_0``). The program computed no gradient for it,
the compile warned it "not used by forward", and at dp 2 ``--verify`` passed: the parameter
never trained. Now capture reads it as the parameter (``frontend/held_params.py``), the
compile stops (internal error) when the model computes a gradient for a parameter the
program does not hold, and ``--verify`` counts such a gradient as a mismatch.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.errors import PlanError
from parallelizer.frontend import capture as capture_module
from parallelizer.frontend.held_params import held_parameters as held_parameters_of
from parallelizer.frontend.spec import Spec
from parallelizer.runtime.verify import _Tally, _unheld_gradients

D, V, T = 32, 64, 8


class _Block(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.table = [table]  # held, not registered: the model owns it

    def forward(self, x):
        x = x + self.table[0]
        return x + self.down(F.gelu(self.up(x)))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.table = nn.Parameter(torch.randn(T, D) * 0.1)
        self.blocks = nn.ModuleList(_Block(self.table) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _compile(tp: int, dp: int = 1):
    torch.manual_seed(0)
    batch = (torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": {"tp": tp, "dp": dp}})
    return compiler.compile_module(_Model(), batch, spec, lambda out, b: F.cross_entropy(
        out.reshape(-1, V), b[0].reshape(-1)))


def test_a_parameter_held_in_a_list_is_read_as_the_parameter():
    program = _compile(tp=2)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert "table" in program.plan.tensors and "grad.table" in program.reference
    assert not any("lifted_tensor" in src for src in program.sources.values())


def test_a_gradient_the_program_does_not_hold_stops_the_compile(monkeypatch):
    monkeypatch.setattr(capture_module, "read_as_parameters", lambda gm, held: [])
    with pytest.raises(PlanError, match=r"internal error .*computes a gradient for table on "
                                        r"the example batch, but the captured graph does not "
                                        r"read it"):
        _compile(tp=1, dp=2)


def test_verify_counts_a_reference_gradient_no_stage_holds():
    program = _compile(tp=1, dp=2)
    tally = _Tally(1e-5, 1e-5)
    _unheld_gradients(tally, program.plan, dict(program.reference))
    assert tally.bad["gradients"] == 0
    _unheld_gradients(tally, program.plan, {**program.reference, "grad.ghost": torch.ones(1)})
    assert tally.bad["gradients"] == 1 and tally.worst["gradients"].startswith("ghost: ")


class _Variable:
    """keras 3's torch backend: a weight object whose private ``_value`` is the parameter."""

    def __init__(self, value):
        self._value = value


class _Dense(nn.Module):
    """Registered nowhere: keras 3 keeps sublayers in plain lists and every parameter in its
    root's ParameterDict; the layer reads its weights through ``_Variable``s."""

    def __init__(self, d_in, d_out, act=None):
        super().__init__()
        self.kernel = _Variable(nn.Parameter(torch.randn(d_in, d_out) * d_in ** -0.5))
        self.bias = _Variable(nn.Parameter(torch.randn(d_out) * 0.1))
        self.act = act

    def forward(self, x):
        y = torch.matmul(x, self.kernel._value) + self.bias._value
        return self.act(y) if self.act else y


class _HeldLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layers = [(nn.LayerNorm(D), _Dense(D, 4 * D, F.gelu), _Dense(4 * D, D))
                       for _ in range(2)]
        weights = {f"l{i}/{j}/{n}": p for i, layer in enumerate(self.layers)
                   for j, m in enumerate(layer) for n, p in m.named_parameters()}
        weights.update({f"l{i}/{j}/{n}": v._value for i, layer in enumerate(self.layers)
                        for j, m in enumerate(layer) for n, v in vars(m).items()
                        if isinstance(v, _Variable)})
        self.weights = nn.ParameterDict(weights)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, up, down in self.layers:
            x = x + down(up(norm(x)))
        return self.head(x)


def test_parameters_of_unregistered_layers_are_trained_parameters_under_sequence_parallel():
    """Read through an object's private attribute, or registered in a module no registry
    holds: export lifted them as constants. Once read as the parameters, their example
    values still needed no gradient, so sequence parallelism took the norms' weights and
    the row linears' biases for buffers and left their gradients one rank's part (the
    self-check: an internal error; without it, a wrong program)."""
    model = _HeldLayers()
    names = {n for n, _ in held_parameters_of(model)}
    assert {"weights.l0/1/kernel", "weights.l1/2/bias", "weights.l0/0/weight"} <= names
    torch.manual_seed(0)
    batch = (torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1)),)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    program = compiler.compile_module(model, batch, spec, lambda out, b: F.cross_entropy(
        out.reshape(-1, V), b[0].reshape(-1)))
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 2 tp rank\(s\) of the program against the model", note), note
    assert "6 parameter read(s) with gradients summed over tp" in program.report
    assert not any("lifted_tensor" in src for src in program.sources.values())


class _Irreps(tuple):
    """e3nn's ``o3.Irreps``: a tuple whose ``__len__`` raises on purpose."""

    def __len__(self):
        raise NotImplementedError


def test_an_attribute_that_refuses_its_length_holds_nothing():
    """Every e3nn module holds Irreps; the walk's ``list(value)`` raised NotImplementedError,
    an uncaught traceback at every layout (zoo 20 Z6). Iterating it is left to the object:
    when that raises, nothing is held there, and the model's own parameters are found."""
    model = _Model()
    for b in model.blocks:
        b.irreps = _Irreps((D, 4 * D))
    assert [t for _, t in held_parameters_of(model)] == [model.table]
