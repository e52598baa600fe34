"""The package layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml
(cli -> api | advisor | convert -> compiler -> planning | passes | emit -> analysis ->
runtime -> frontend -> checkpoint -> plan -> errors; the runtime reads only the front end's
model.py loader; checkpoint conversion imports no model code; no import cycles).

The second test shows each kind of contract failing on a copy of the package with one
violating import added, so the first cannot pass vacuously.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports finds the package on sys.path: run it where `parallelizer` is root's copy
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_package_layers_kept():
    p = _lint(REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("runtime/setup.py", "from ..compiler import compile_model", "layers"),
    ("runtime/setup.py", "from ..frontend import spec", "the runtime"),
    ("planning/tp.py", "from ..passes import tensor_parallel", "layers"),
    ("analysis/graph_facts.py", "from ..planning import pipeline", "layers"),
    ("checkpoint/reader.py", "from ..runtime import setup", "layers"),
    ("convert/target.py", "from ..frontend import capture", "checkpoint conversion"),
    ("plan/parallel_plan.py", "from ..advisor.memory import DTYPE_BYTES", "layers"),
    ("runtime/batching.py", "from .step import StepRunner", "no import cycles"),
])
def test_a_violating_import_breaks_its_contract(tmp_path, module, line, contract):
    shutil.copytree(REPO / "parallelizer", tmp_path / "parallelizer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "parallelizer" / module
    target.write_text(target.read_text() + f"\n{line}  # violation added by the test\n")
    p = _lint(tmp_path)
    assert p.returncode != 0, p.stdout
    broken = p.stdout[p.stdout.index("Broken contracts"):]
    assert contract in broken, p.stdout
