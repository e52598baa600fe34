"""Activation checkpointing on emitted blocks: the chosen blocks run their forward again in
backward (recompute), the others do not, FQNs are unchanged and gradients are identical."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallelizer.checkpoint.reader import load_full
from parallelizer.compiler import compile_model
from parallelizer.runtime.stage_builder import apply_activation_checkpointing, import_stage_class
from parallelizer.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("ac") / "out"
    spec = load_spec(REPO / "examples/gpt/spec.yaml", ["mesh.tp=1", "mesh.dp=1", "mesh.pp=1"])
    compile_model(REPO / "examples/gpt/model.py", spec).save(out)
    return out


def _run(out, plan, mode, every):
    plan = plan.with_activation_checkpointing(mode, every)
    stage = import_stage_class(out, 0)("cpu")
    stage.load_state_dict({k: v for k, v in load_full(out / "checkpoint").items()
                           if k in stage.state_dict()}, strict=True)
    calls = {}
    for name, block in stage.emitted_blocks():
        inner = block.forward

        def counted(*args, _inner=inner, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _inner(*args)
        block.forward = counted
    names_before = [n for n, _ in stage.named_parameters()]
    apply_activation_checkpointing(stage, plan)
    assert [n for n, _ in stage.named_parameters()] == names_before
    idx = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    stage(idx)[0].pow(2).mean().backward()
    return calls, {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_full_and_selective_recompute_the_chosen_blocks(gpt_out):
    from parallelizer.plan.parallel_plan import ParallelPlan
    plan = ParallelPlan.from_json((gpt_out / "plan.json").read_text())
    calls, grads = _run(gpt_out, plan, "none", 1)
    assert set(calls.values()) == {1}
    calls_full, grads_full = _run(gpt_out, plan, "full", 1)
    assert set(calls_full.values()) == {2}, calls_full
    calls_sel, grads_sel = _run(gpt_out, plan, "selective", 2)
    assert calls_sel == {"blocks.0": 2, "blocks.1": 1, "blocks.2": 2, "blocks.3": 1}
    for n in grads:
        assert torch.equal(grads[n], grads_full[n]) and torch.equal(grads[n], grads_sel[n]), n
