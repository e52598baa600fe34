"""The modules a model.py imports from its own folder (frontend/model_sources.py): found on
import as ``python model.py`` would, and listed under their import paths for OUT/model_deps/.
The run of such a program from a copy alone: tests/distributed/test_user_models.py."""
import sys
import textwrap
from pathlib import Path

import pytest

from parallelizer.frontend.model_file import load_model_file
from parallelizer.frontend.model_sources import MODEL_DEPS, import_root, local_modules
from parallelizer.plan.parallel_plan import MODEL_MODULE

MODEL = """
import torch
from ms_sibling import WIDTH
from ms_pkg.layers import make

def build_model():
    return make(WIDTH)

def example_inputs():
    return (torch.randn(2, WIDTH),)
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


@pytest.fixture
def isolated(monkeypatch):
    """sys.path and the ms_* modules as they were before the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [n for n in sys.modules if n.startswith(("ms_", MODEL_MODULE))]:
        del sys.modules[name]


def project(root: Path) -> Path:
    write(root / "ms_sibling.py", "WIDTH = 4\n")
    write(root / "ms_pkg" / "__init__.py", "")
    write(root / "ms_pkg" / "layers.py", "from torch import nn\n\ndef make(w):\n    return nn.Linear(w, w)\n")
    return write(root / "model.py", MODEL)


def test_a_model_importing_its_neighbours_loads_from_any_folder(tmp_path, isolated, monkeypatch):
    model = project(tmp_path / "proj")
    monkeypatch.chdir(tmp_path)  # not the model's folder
    module = load_model_file(model)
    assert module.build_model().in_features == 4
    assert sys.path[0] == str(model.parent.resolve())


def test_local_modules_are_the_model_folders_own(tmp_path, isolated):
    model = project(tmp_path / "proj")
    write(tmp_path / "proj" / "venv" / "lib" / "site-packages" / "ms_installed.py", "X = 1\n")
    write(tmp_path / "proj" / "ms_by_path.py", "Y = 2\n")
    load_model_file(model)
    sys.path.insert(0, str(tmp_path / "proj" / "venv" / "lib" / "site-packages"))
    __import__("ms_installed")
    import importlib.util
    spec = importlib.util.spec_from_file_location("ms_other_name", tmp_path / "proj" / "ms_by_path.py")
    sys.modules["ms_other_name"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["ms_other_name"])

    found = local_modules(model, MODEL_MODULE)
    # installed code, a module loaded under a name its path does not spell, model.py itself,
    # torch and parallelizer are not model code
    assert list(found) == ["ms_pkg/__init__.py", "ms_pkg/layers.py", "ms_sibling.py"]
    assert found["ms_pkg/layers.py"] == (tmp_path / "proj" / "ms_pkg" / "layers.py").resolve()


def test_an_emitted_model_imports_from_model_deps(tmp_path, isolated):
    out = tmp_path / "out"
    write(out / "model.py", MODEL)
    for rel in ("ms_sibling.py", "ms_pkg/__init__.py", "ms_pkg/layers.py"):
        write(out / MODEL_DEPS / rel, (project(tmp_path / "src").parent / rel).read_text())
    assert import_root(out / "model.py") == (out / MODEL_DEPS).resolve()
    module = load_model_file(out / "model.py")
    assert module.build_model().in_features == 4
    assert Path(sys.modules["ms_pkg.layers"].__file__).resolve().is_relative_to(out / MODEL_DEPS)
    # compiled again from OUT: the copies keep their import paths
    assert list(local_modules(out / "model.py", MODEL_MODULE)) == [
        "ms_pkg/__init__.py", "ms_pkg/layers.py", "ms_sibling.py"]
