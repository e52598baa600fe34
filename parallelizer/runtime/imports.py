"""Import the modules a program needs before it builds its stages (``plan.imports``: custom
operator libraries the graph calls, the modules of the output pytree's types; recorded at
compile time by :func:`parallelizer.analysis.needed_imports.modules_needed`)."""
from __future__ import annotations

import importlib


def import_modules(names) -> str | None:
    """Import each of ``names``; one line saying which failed and how to fix it, or None."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            return (f"this program needs module {name} (it registers a custom operator the "
                    f"graph calls or a type of the model's outputs; recorded in plan.json "
                    f"'imports' at compile time), and importing it failed: "
                    f"{type(e).__name__}: {e}; install the package that provides it, in the "
                    f"version used to compile")
    return None
