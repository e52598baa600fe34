"""Training modes (frontend/modes.py): a model built all in eval mode is compiled in
training mode, with a warning naming its mode-dependent modules; a model with modules in
both modes keeps each module's mode as built (a frozen BatchNorm: captured as eval runs it,
its running statistics read, not written). Was: every model switched to training mode,
silently."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallelizer.compiler import analyse
from parallelizer.frontend.modes import training_modes
from parallelizer.passes.manager import PassManager

aten = torch.ops.aten


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 4))


def _batch_norm_training(model) -> list:
    gm = analyse(model, (torch.randn(6, 4),), Path("<test>"), PassManager()).gm
    return [n.args[5] for n in gm.graph.nodes if n.target is aten.batch_norm.default]


def test_a_model_built_in_eval_mode_is_compiled_in_training_mode_with_a_warning():
    model = _model().eval()
    (warning,) = training_modes(model)
    assert all(m.training for m in model.modules())
    assert "its BatchNorm1d, Dropout modules run as in training" in warning
    assert training_modes(nn.Sequential(nn.Linear(2, 2)).eval()) == []  # nothing depends on it


def test_a_frozen_batch_norm_is_captured_as_eval_runs_it():
    model = _model()
    model[1].eval()  # frozen: normalises by its running statistics, writes none
    model[1].running_mean.uniform_(-1, 1)
    before = model[1].running_mean.clone()
    assert training_modes(model) == [] and not model[1].training and model[0].training
    assert _batch_norm_training(model) == [False]
    assert torch.equal(model[1].running_mean, before)
    assert _batch_norm_training(_model()) == [True]


def test_a_frozen_batch_norm_compiles_and_exports_without_its_count(tmp_path, capsys):
    """The frozen BatchNorm never reads its ``num_batches_tracked``: no stage holds it and
    export leaves it out, saying so (it raised "state_dict key ... is not stored in the
    checkpoint"); its running statistics are exported as built."""
    from safetensors.torch import load_file

    from parallelizer import compiler
    from parallelizer.cli.parallelize import main as cli
    from parallelizer.frontend.spec import Spec
    model = _model()
    model[1].eval()
    model[1].running_mean.uniform_(-1, 1)
    program = compiler.compile_module(model, (torch.randn(6, 4),),
                                      Spec.model_validate({"mesh": {"tp": 2}}), reference=False)
    program.save(tmp_path / "out")
    assert cli(["export", str(tmp_path / "out" / "checkpoint"), "-o", str(tmp_path / "hf")]) == 0
    assert "not exported: 1 state_dict key(s) the model's forward never reads " \
           "(1.num_batches_tracked)" in capsys.readouterr().out
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert "1.num_batches_tracked" not in hf
    assert torch.equal(hf["1.running_mean"], model[1].running_mean)
