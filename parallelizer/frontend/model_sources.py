"""The Python files a model.py imports from its own folder, and the path that finds them.

A model.py is often one file of a project: ``from layers import Attention`` next to it, or
``from mypkg.blocks import Block`` below it. ``python model.py`` finds those because Python
puts the script's folder first on ``sys.path``; the compiler imports model.py by path
(``importlib``), so :func:`import_root` does the same. The emitted ``OUT/model.py`` is a
copy, and ``torchrun OUT/run.py`` runs on machines that may not have the user's folder: the
compile copies every module model.py imported from its folder (:func:`local_modules`) to
``OUT/model_deps/`` under its module path, and ``run.py`` puts that folder first instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the folder of OUT holding the copies, beside OUT/model.py
MODEL_DEPS = "model_deps"

# never copied: installed code, and the compiler itself
_INSTALLED = {"site-packages", "dist-packages"}


def import_root(model_path: Path) -> Path:
    """Put the folder model.py's own imports resolve from first on ``sys.path``: ``OUT/model_deps``
    beside an emitted model.py, else model.py's folder (as ``python model.py`` would). Returns
    that folder. Kept for the process: a model may import lazily, inside its forward."""
    folder = Path(model_path).resolve().parent
    deps = folder / MODEL_DEPS
    root = deps if deps.is_dir() else folder
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


def local_modules(model_path: Path, skip: str) -> dict[str, Path]:
    """Modules loaded in this process whose file lies under model.py's folder (or the
    ``model_deps`` beside it), keyed by their path relative to their import root:
    ``{"layers.py": ..., "mypkg/__init__.py": ..., "mypkg/blocks.py": ...}``. ``skip``:
    model.py's own module name. Installed packages (a ``site-packages`` folder inside it), the
    interpreter's own files and parallelizer are not model code and are left out, as is a
    module whose file does not sit at its import name (loaded by path under another name)."""
    model_path = Path(model_path).resolve()
    folder = model_path.parent
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name == skip or name.split(".")[0] == "parallelizer":
            continue
        path = Path(file).resolve()
        if path == model_path or not path.is_relative_to(folder) \
                or _INSTALLED & set(path.parts) or any(path.is_relative_to(p) for p in prefixes):
            continue
        rel = _import_path(name, path)
        if rel is not None:
            out[rel] = path
    return dict(sorted(out.items()))


def _import_path(name: str, path: Path) -> str | None:
    """``mypkg/blocks.py`` for module ``mypkg.blocks`` at ``.../mypkg/blocks.py`` (its
    ``__init__.py`` for a package); None when the file's folders do not spell the name."""
    parts = name.split(".")
    stem = path.parent.name if path.stem == "__init__" else path.name.split(".")[0]
    folders = path.parts[:-1] if path.stem != "__init__" else path.parts[:-2]
    want = parts[:-1]
    if stem != parts[-1] or list(folders[len(folders) - len(want):]) != want:
        return None
    tail = ([parts[-1], path.name] if path.stem == "__init__" else [path.name])
    return "/".join(want + tail)
