"""A branch on the data captured as the example takes it (``capture.data_dependent_branches:
as_example``, frontend/branches.py) on 4 gloo ranks at tp2 x pp2: ``--verify`` PASSes on the
example's branch, and a training step whose batch takes the other branch stops with the
error naming the model's line, not with another model's numbers."""
from __future__ import annotations

from pathlib import Path

import pytest

from parallelizer.compiler import compile_model
from parallelizer.frontend.spec import load_spec

MODELS = Path(__file__).parent / "user_models"


@pytest.mark.timeout(400)
def test_the_examples_branch_verifies_and_the_other_stops_naming_the_line(tmp_path, tools):
    spec = load_spec(MODELS / "spec.yaml", ["mesh.tp=2", "mesh.pp=2",
                                            "capture.data_dependent_branches=as_example"])
    program = compile_model(MODELS / "padding_test.py", spec)
    program.save(tmp_path / "out")
    assert any("at padding_test.py:26: if not pad.any():" in w for w in program.warnings), \
        program.warnings
    res = tools.torchrun(tmp_path / "out", 4, "--verify", timeout=240)
    assert "PASS" in res.stdout, res.explain()
    tools.check_exit(res)
    res = tools.torchrun(tmp_path / "out", 4, "--train", "--steps", "2", timeout=240)
    assert res.code != 0 and "step 1 loss" in res.stdout, res.explain()
    assert "this step takes another branch of the model's code than the example batch took at " \
           "compile (capture.data_dependent_branches: as_example): padding_test.py:26: if not " \
           "pad.any():" in res.output, res.explain()
