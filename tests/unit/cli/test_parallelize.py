"""parallelize CLI: argument and spec errors exit 2 with one `error:` line and write nothing;
an internal error exits 3.

The compiler itself is replaced by a recording fake (tests/e2e covers the real one).
"""
import sys
import types

import pytest

from parallelizer.cli import parallelize as cli
from parallelizer.errors import PlanError


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("def build_model():\n    raise NotImplementedError\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("mesh: {tp: 2}\n")
    return model, spec, tmp_path / "out"


@pytest.fixture
def fake_compiler(monkeypatch):
    calls = []
    module = types.ModuleType("parallelizer.compiler")
    module.compile_to_dir = lambda *args, **kwargs: calls.append((args, kwargs))
    monkeypatch.setitem(sys.modules, "parallelizer.compiler", module)
    return calls


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_missing_spec_file(capsys, files, fake_compiler):
    model, spec, out = files
    code, err = run(capsys, model, spec.with_name("nope.yaml"), "-o", out)
    assert code == 2 and err.startswith("error: spec file") and "nope.yaml does not exist" in err
    assert not out.exists() and fake_compiler == []


def test_missing_model_file(capsys, files, fake_compiler):
    model, spec, out = files
    code, err = run(capsys, model.with_name("nope.py"), spec, "-o", out)
    assert code == 2 and err.startswith("error: model file") and "nope.py" in err
    assert not out.exists() and fake_compiler == []


@pytest.mark.parametrize("override, words", [
    ("mesh.tp", ["malformed override 'mesh.tp'", "KEY=VALUE"]),
    ("mesh.tp=0", ["mesh.tp", "got 0", ">= 1"]),
    ("mesh.tq=2", ["mesh.tq", "mesh.tp"]),
])
def test_bad_override(capsys, files, fake_compiler, override, words):
    model, spec, out = files
    code, err = run(capsys, model, spec, "-o", out, override)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert all(w in err for w in words), err
    assert not out.exists() and fake_compiler == []


def test_missing_out_is_usage_error(capsys, files, fake_compiler):
    model, spec, _ = files
    code, err = run(capsys, model, spec)
    assert code == 2 and "-o/--out" in err and fake_compiler == []


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "MODEL SPEC -o OUT" in out
    # where the next step's flags are: the compiled program's own --help
    assert "OUT/run.py --help" in " ".join(out.split()) and "reshard" in out


def test_compile_gets_spec_with_overrides(capsys, files, fake_compiler):
    model, spec, out = files
    code, err = run(capsys, model, spec, "mesh.dp=2", "-o", out, "--no-weights",
                    "--dump-passes", out / "passes", "seed=7")
    assert (code, err) == (0, "")
    (args, kwargs), = fake_compiler
    assert args[0] == model and args[2] == out
    assert (args[1].mesh.dp, args[1].mesh.tp, args[1].seed) == (2, 2, 7)
    from parallelizer.emit.launch import Topology  # no --nodes: one node of the mesh's world
    assert kwargs == {"weights": False, "dump_passes": out / "passes",
                      "topology": Topology(1, 4, None)}


def test_user_error_from_compiler_exits_2(capsys, files, monkeypatch):
    def fail(*args, **kwargs):
        raise PlanError("tp (2) must divide num_key_value_heads (1) of model.layers.0.self_attn")

    module = types.ModuleType("parallelizer.compiler")
    module.compile_to_dir = fail
    monkeypatch.setitem(sys.modules, "parallelizer.compiler", module)
    model, spec, out = files
    code, err = run(capsys, model, spec, "-o", out)
    assert code == 2 and err == "error: tp (2) must divide num_key_value_heads (1) of model.layers.0.self_attn\n"


def test_subcommand_dispatch(monkeypatch):
    seen = []
    monkeypatch.setitem(cli.SUBCOMMANDS, "inspect", lambda argv: seen.append(argv) or 0)
    assert cli.main(["inspect", "out", "--x"]) == 0
    assert seen == [["out", "--x"]]


def test_python_dash_m(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(cli.__file__).resolve().parents[2])  # works without `pip install -e`
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "parallelizer", "m.py", "s.yaml", "-o", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: model file m.py")
    assert not (tmp_path / "out").exists()


def test_an_internal_error_exits_3_and_a_refusal_2(monkeypatch, capsys):
    """A script tells a bug from a refusal by the status (both were 2; zoo 18 Z6)."""
    for message, code in (("internal error (a bug in parallelizer, please report it): x", 3),
                          ("mesh.tp=3 does not divide the 4 heads", 2)):
        def fail(_args, message=message):
            raise PlanError(message)
        monkeypatch.setattr(cli, "_compile", fail)
        assert cli.main(["model.py", "spec.yaml", "-o", "out"]) == code
        assert capsys.readouterr().err == f"error: {message}\n"
