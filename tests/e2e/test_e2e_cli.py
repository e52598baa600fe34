"""The real ``parallelize`` command and the emitted ``run.py``, end to end, in subprocesses:
user errors (exit 2, one short message naming the key, the module and the fix; nothing
written), --no-weights, and training on batch shapes other than the example inputs'."""
import math
import re

import pytest

LLAMA = ("llama/model.py", "llama/spec.yaml")
MESH_4 = ("mesh.dp=1", "mesh.tp=2", "mesh.pp=2")  # also a case of test_equivalence: shared compile


def _compile(tools, tmp_path, example, *args):
    model, spec = (tools.examples / p for p in example)
    return tools.parallelize(model, spec, tmp_path / "out", *args)


def _short_error(stderr: str) -> str:
    """The one short paragraph a user error prints (no traceback)."""
    text = stderr.strip()
    assert text.startswith("error: ") and "Traceback" not in text, stderr
    assert "\n\n" not in text and len(text.splitlines()) <= 3 and len(text) <= 400, stderr
    return text


@pytest.mark.timeout(300)
# tp=4 with 2 kv heads is valid (each kv head copied to two ranks); at 3 neither the heads
# nor the MLP (128) divide, so nothing is left to shard
def test_tp_not_dividing_heads_is_refused(tools, tmp_path):
    res = _compile(tools, tmp_path, LLAMA, "mesh.dp=1", "mesh.tp=3", "mesh.pp=1")
    assert res.code == 2, res.explain()
    text = _short_error(res.stderr)
    for word in ("mesh.tp (3)", "(4)", "model.layers.0.self_attn", "{1, 2, 4}"):
        assert word in text, (word, text)
    assert list(tmp_path.iterdir()) == [], "OUT or a temporary folder was left behind"


@pytest.mark.timeout(300)
def test_tp_above_the_query_heads_keeps_attention_whole_with_a_warning(tools, tmp_path):
    """8 exceeds the 4 query heads but divides the MLP: attention's linears are kept whole
    on every rank, the MLP sharded, and the compile says so (decision 73)."""
    res = _compile(tools, tmp_path, LLAMA, "mesh.dp=1", "mesh.tp=8", "mesh.pp=1")
    assert res.code == 0, res.explain()
    warning = next(line for line in res.stderr.splitlines() if line.startswith("warning: mesh.tp=8"))
    for word in ("keeps 12 linears whole on every tp rank", "the number of heads (4) of "
                 "model.layers.0.self_attn", "tp in {2, 4} shards them too"):
        assert word in warning, (word, warning)
    assert "self-check:" in res.stdout + res.stderr


@pytest.mark.timeout(300)
def test_existing_foreign_folder_is_refused(tools, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    res = _compile(tools, tmp_path, LLAMA, "mesh.dp=1", "mesh.tp=2", "mesh.pp=1")
    assert res.code == 2, res.explain()
    text = _short_error(res.stderr)
    assert str(out) in text and "-o" in text, text
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "a temporary folder was left behind"


@pytest.mark.timeout(300)
def test_no_weights_writes_program_without_checkpoint(tools, tmp_path):
    res = _compile(tools, tmp_path, LLAMA, "--no-weights", "mesh.dp=1", "mesh.tp=2", "mesh.pp=2")
    assert res.code == 0, res.explain()
    out = tmp_path / "out"
    for name in ("run.py", "plan.json", "report.md"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "program").iterdir()) == ["stage0.py", "stage1.py"]
    assert not (out / "checkpoint").exists()
    assert not (out / "reference.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "a temporary folder was left behind"


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *MESH_4)
def test_world_size_mismatch_is_one_line(compiled, tools):
    out = compiled("llama", *MESH_4)
    res = tools.real_torchrun(out, 2, "--verify")  # the user's command, torchrun's own agent
    assert res.code != 0, res.explain()
    lines = [line for line in res.output.splitlines() if line.startswith("run.py: ")]
    assert len(lines) == 1, res.explain()
    pattern = (r"run\.py: this program was compiled for mesh pp=2 x dp=1 x tp=2 = 4 ranks but "
               r"WORLD_SIZE is 2; launch it with torchrun --nproc-per-node 4 \S*run\.py")
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert "verify:" not in res.stdout


# Appended to a copy of examples/gpt/model.py: batches of other sizes than the example's (8, 16).
OTHER_SHAPES = '''

def batches():
    yield (_random_idx(11, batch=4, seq=12),)
    yield (_random_idx(12, batch=6, seq=20),)
'''


@pytest.mark.timeout(300)
def test_program_trains_on_other_batch_and_sequence_sizes(tools, tmp_path):
    model = tmp_path / "model.py"
    model.write_text((tools.examples / "gpt" / "model.py").read_text() + OTHER_SHAPES)
    res = tools.parallelize(model, tools.examples / "gpt" / "spec.yaml", tmp_path / "out",
                            "mesh.dp=1", "mesh.tp=2", "mesh.pp=1")
    assert res.code == 0, res.explain()
    # ranks forked from the warm server: the real torchrun runs run.py --train in test_restart.py
    res = tools.torchrun(tmp_path / "out", 2, "--train", "--steps", "2")
    losses = tools.step_losses(res.stdout)
    print(f"\nlosses on (4, 12) and (6, 20): {losses}")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), res.explain()
    # An untrained model over a 96-token vocabulary: cross-entropy near ln(96) = 4.56.
    assert all(abs(x - math.log(96)) < 0.5 for x in losses), losses
    tools.check_exit(res)
