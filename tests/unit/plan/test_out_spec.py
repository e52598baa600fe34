"""A model whose forward returns a ``typing.NamedTuple`` (infini-transformer-pytorch's
``TransformerReturn(logits, cached_kvs, past_memories)``, zoo 18 Z2). torch writes a
namedtuple's TreeSpec only under a name registered for its class, so every layout was
refused ("cannot be sent between processes ... Please register using
`_register_namedtuple`"). plan/out_spec.py registers each under ``module.QualName`` before
writing and resolves it from its module before reading: the spec round-trips in a process
that never registered the class, and a model returning one (with a None field, as
infini-transformer's) compiles at tp2 with the self-check and its reference step.

A ``@dataclass`` output is no pytree node at all until registered: the capture refused it,
"not a tensor, so torch.export cannot capture it" (zoo 24). The capture registers each one
an export refused (``torch.export.register_dataclass``, under ``module.QualName``), and the
plan reads it back the same way."""
import dataclasses
import json
import subprocess
import sys
import typing

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from parallelizer import compiler
from parallelizer.errors import PlanError
from parallelizer.frontend.spec import Spec
from parallelizer.plan import out_spec


class Return(typing.NamedTuple):
    logits: torch.Tensor
    cached: typing.Optional[list]
    memories: typing.Optional[torch.Tensor]


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                    for _ in range(2))

    def forward(self, x):
        cached = []
        for block in self.blocks:
            x = x + block(x)
            cached.append(x)
        return Return(x, cached, None)


def test_a_namedtuple_spec_round_trips_in_a_fresh_process():
    spec = pytree.tree_flatten(Return(torch.ones(1), [torch.ones(1)], None))[1]
    text = out_spec.dumps(spec)
    assert json.loads(text)[1]["context"] == f"{__name__}.Return"
    assert out_spec.loads(text) == spec
    # a process that imports this module (as run.py imports the model's) and never
    # registered the class reads it back
    code = (f"import sys; sys.path[:0] = {sys.path!r}; from parallelizer.plan import out_spec; "
            f"s = out_spec.loads({text!r}); print(s.context.__qualname__, s.num_leaves)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Return", "3"], out


def test_a_model_returning_a_namedtuple_compiles():
    torch.manual_seed(0)
    program = compiler.compile_module(
        _Model(), (torch.randn(4, 5, 8),), Spec.model_validate({"mesh": {"tp": 2}}),
        lambda out, batch: out.logits.pow(2).mean())
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "4 output(s)" in note, note  # x, both cached and the None
    assert "Return" in program.plan.out_spec


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class _DataclassModel(_Model):
    def forward(self, x):
        out = super().forward(x)
        return Out(out.logits, out.logits.mean(-1))


def test_a_model_returning_a_dataclass_compiles_and_its_spec_round_trips():
    torch.manual_seed(0)
    program = compiler.compile_module(
        _DataclassModel(), (torch.randn(4, 5, 8),), Spec.model_validate({"mesh": {"tp": 2}}),
        lambda out, batch: out.logits.pow(2).mean() + out.aux.pow(2).mean())
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "2 output(s)" in note, note
    text = program.plan.out_spec
    assert json.loads(text)[1]["type"] == f"{__name__}.Out", text
    # a process that imports this module (as run.py imports the model's) and never
    # registered the class reads it back and rebuilds the output
    code = (f"import sys; sys.path[:0] = {sys.path!r}; import torch; "
            f"from torch.utils._pytree import tree_unflatten; "
            f"from parallelizer.plan import out_spec; s = out_spec.loads({text!r}); "
            f"o = tree_unflatten([torch.ones(1), torch.zeros(1)], s); "
            f"print(type(o).__qualname__, float(o.logits), float(o.aux))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Out", "1.0", "0.0"], out


def test_an_output_class_whose_module_is_gone_is_named_by_its_kind():
    """The error named every missing output class a namedtuple, a dataclass's too."""
    tree = {"type": "nowhere_pkg.Out", "context": "[]", "children_spec": []}
    with pytest.raises(ImportError, match=r"^the model's output is a class nowhere_pkg\.Out, "
                                          r"whose module cannot be imported here"):
        out_spec.loads(json.dumps([1, tree]))
    tree = {"type": "collections.namedtuple", "context": "nowhere_pkg.Ret", "children_spec": []}
    with pytest.raises(ImportError, match=r"^the model's output is a namedtuple nowhere_pkg"):
        out_spec.loads(json.dumps([1, tree]))


def test_a_none_output_under_pp_is_refused_at_compile_time():
    """torch.distributed.pipelining checks each value the last stage returns is a tensor:
    the run crashed ("Stage arg[3] is None"); the compile refuses it naming the field."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    with pytest.raises(PlanError, match=r"output 3 \(outputs\.memories\) of the model is None; "
                                        r"under mesh\.pp > 1"):
        compiler.compile_module(_Model(), (torch.randn(4, 5, 8),), spec,
                                lambda out, batch: out.logits.pow(2).mean(), reference=False)
