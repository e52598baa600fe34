"""A buffer region the step wrote whole, read later, is read from the written value
(frontend/buffer_reads.py). rotary-embedding-torch's cache (FLASH-pytorch: one
RotaryEmbedding handed to every layer, zoo 18 Z1): layer 0 writes ``cached[:n]``, layers 1-3
read it. Each block and stage holds its own copy of a buffer, so the compile refused the
model at every layout ("held by layers.0, ..., layers.3 as one tensor and written in
place"). Now the three reads are the written table, only layer 0 holds the buffer, and
every layout compiles; the tp2 program equals the model (the self-check, the buffer after the
step included). What would change a value is not forwarded and stays refused: a read of
another region, a source written after the write, a counter's read-modify-write
(tests/features/test_user_errors.py). tp2 x pp2 with --verify:
tests/distributed/test_complex_pipelines.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from parallelizer import compiler
from parallelizer.analysis.graph_facts import block_of
from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec

FILE = Path(__file__).parents[2] / "distributed" / "user_models" / "cached_rotary.py"
BLOCKS = tuple(f"layers.{i}" for i in range(4))


def _module():
    spec = importlib.util.spec_from_file_location("cached_rotary", FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _readers(gm) -> set:
    """The blocks whose nodes read the cache."""
    return {block_of(u, BLOCKS) for n in gm.graph.nodes
            if n.op == "get_attr" and n.target.endswith("rotary.cached") for u in n.users}


def test_reads_of_the_written_region_take_the_written_table():
    m = _module()
    gm = capture(m.build_model(), m.example_inputs(), FILE).gm
    assert _readers(gm) == {"layers.0"}  # its write; layers 1-3 read it before
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 1


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}])
def test_a_shared_cache_compiles_at_every_layout(mesh):
    m = _module()
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2}})
    program = compiler.compile_module(m.build_model(), m.example_inputs(), spec, m.loss_fn,
                                      model_file=FILE, reference=False)
    if mesh.get("tp", 1) > 1:
        (note,) = [n for n in program.notes if n.startswith("self-check")]
        assert "1 buffer(s) the forward writes" in note, note
        assert "16 of 16 weight matrices in blocks sharded" in "\n".join(program.notes)


def test_a_read_of_another_region_is_not_forwarded(monkeypatch):
    m = _module()
    monkeypatch.setattr(m, "CACHE_REGION", lambda cached, n: cached[1:n + 1])
    gm = capture(m.build_model(), m.example_inputs(), FILE).gm
    assert _readers(gm) == set(BLOCKS)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    with pytest.raises(PlanError, match=r"buffer layers\.0\.rotary\.cached is held by layers\.0, "
                                        r"layers\.1, layers\.2, layers\.3 as one tensor"):
        compiler.compile_module(m.build_model(), m.example_inputs(), spec, m.loss_fn,
                                model_file=FILE, reference=False)


def test_a_source_written_after_the_write_is_not_forwarded(monkeypatch):
    """``cached[:n] = table; table.mul_(2)``: the cache holds the table before the write into
    it, which a read of the table would not."""
    m = _module()
    monkeypatch.setattr(m, "SCALE_AFTER_WRITE", True)
    gm = capture(m.build_model(), m.example_inputs(), FILE).gm
    assert _readers(gm) == set(BLOCKS)
