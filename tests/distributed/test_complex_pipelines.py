"""Complex values across pipeline stages (issue 23, part 4), in one 4-rank torchrun launch
(user_models_entry.py), each program with ``--verify``: loss, outputs, gradients and
parameters after one SGD step against the unmodified model, fp32, atol = rtol = 1e-5.

- Complex activations carrying gradient between every block and stage
  (user_models/complex_hidden.py): sent over gloo and differentiated through, at
  pp2 x dp2 and tp2 x pp2 (ZeRO-3).
- A buffer every block reads: the Llama 3 reference model with its
complex64 rotary table in one ``Rotary`` module that every block holds
(tests/distributed/user_models/llama3_reference.py, ``shared_rotary=True``). It was refused
under pp as "weights shared across blocks (ALBERT-style)"; a buffer carries no gradient, so
each stage and block reading it holds its own copy, and only trained weights take the tied
path (summed over the stages holding them); compiled in-process from the in-memory model,
at pp2 x dp2 and tp2 x pp2 (ZeRO-3); and the reference model as written (the table at the
root, its first rows passed to every block) at tp2 x pp2. Trained weights shared by blocks of
one stage make it one module (tests/features/test_user_errors.py).
- A buffer one block writes and the others read: a rotary table cached by the first layer
  and read by the later ones (user_models/cached_rotary.py, rotary-embedding-torch's
  cache), read from the written value (frontend/buffer_reads.py), at tp2 x pp2 (ZeRO-3)."""
import importlib.util
import re
from pathlib import Path

import pytest

from parallelizer.compiler import compile_model, compile_module
from parallelizer.frontend.spec import load_spec

HERE = Path(__file__).parent
FILE = HERE / "user_models" / "llama3_reference.py"
ENTRY = HERE / "user_models_entry.py"
MESHES = {"pp2-dp2": ("mesh.pp=2", "mesh.dp=2"),
          "tp2-pp2-zero3": ("mesh.pp=2", "mesh.tp=2", "zero_stage=3")}
CASES = [f"{model}-{mesh}" for model in ("complex", "rotary") for mesh in MESHES] + \
    ["llama3-tp2-pp2-zero3", "cached-tp2-pp2-zero3"]
_PROGRAM = re.compile(r"^PROGRAM (\S+) (\d+)$", re.M)
_ERR = re.compile(r"^verify: (loss|outputs|gradients|parameters)\b.*max abs err (\S+)", re.M)
TABLE = "layers.0.attention.rope.freqs_cis"  # the canonical name: the first of five


def _reference():
    spec = importlib.util.spec_from_file_location("llama3_reference", FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(400)
def test_complex_activations_and_shared_rotary_buffer_verified(tmp_path, tools):
    m, outs = _reference(), []
    for mesh, overrides in MESHES.items():
        spec = load_spec(HERE / "user_models" / "spec.yaml", list(overrides))
        program = compile_model(HERE / "user_models" / "complex_hidden.py", spec)
        assert "| layers.1: (batch, seq, 16) complex64 |" in program.report  # stage 0 sends
        outs.append(program.save(tmp_path / f"complex-{mesh}"))
    for mesh, overrides in MESHES.items():
        model = m.build_model(shared_rotary=True)
        names = [n for n, _ in model.named_buffers(remove_duplicate=False)]
        assert len(names) == 5 and TABLE in names, names
        spec = load_spec(HERE / "user_models" / "spec.yaml", list(overrides))
        program = compile_module(model, m.example_inputs(), spec, m.loss_fn, model_file=FILE,
                                 owns_model=True)
        table = program.plan.tensors[TABLE]
        assert table.is_buffer and table.stages == (0, 1) and table.dtype == "complex64"
        assert not [g for g in program.plan.grad_sync if g["kind"] == "tied"]
        for s in (0, 1):  # the block class of each stage holds the table as its own buffer
            src = program.sources[f"program/stage{s}.py"]
            assert "('attention.rope.freqs_cis', (32, 8), 'complex64')" in src, src
        outs.append(program.save(tmp_path / f"rotary-{mesh}"))
    # the reference model as written (its table at the root, passed to every block)
    spec = load_spec(HERE / "user_models" / "spec.yaml", list(MESHES["tp2-pp2-zero3"]))
    outs.append(compile_model(FILE, spec).save(tmp_path / "llama3-tp2-pp2-zero3"))
    cached = compile_model(HERE / "user_models" / "cached_rotary.py", spec)
    outs.append(cached.save(tmp_path / "cached-tp2-pp2-zero3"))
    p = tools.launch(ENTRY, 4, *outs, timeout=380).wait()
    explain = p.explain()
    assert dict(_PROGRAM.findall(p.stdout)) == {n: "0" for n in CASES}, explain
    errs = [float(e) for _, e in _ERR.findall(p.stdout)]
    assert len(errs) == 4 * len(CASES) and max(errs) <= 1e-5, explain
