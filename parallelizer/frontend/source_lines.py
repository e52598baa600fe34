"""How messages name a line of model code: ``file.py:line`` from a node's recorded stack trace
or a live frame, skipping torch's own frames and code that exists in no file."""
from __future__ import annotations

import functools
import os
import re

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_PACKAGES = re.compile(r"[\\/](?:site|dist)-packages[\\/]")
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def trace_lines(stack_trace: str) -> list[str]:
    """``file.py:line`` of every frame of ``stack_trace`` (a node's ``meta["stack_trace"]``)
    outside torch and parallelizer (whose wrapper of a ``*args`` forward export records as
    the outermost frame), innermost first."""
    return [f"{shown_path(path)}:{line}" for path, line in reversed(_FRAME.findall(stack_trace))
            if f"{os.sep}torch{os.sep}" not in path and not path.startswith(_OURS)
            and _source_file(path)]


def model_line(nodes) -> str:
    """``file.py:line`` of the model code the first of ``nodes`` with a stack trace came
    from (its innermost frame outside torch), or ''."""
    for n in nodes:
        frames = trace_lines(n.meta.get("stack_trace") or "")
        if frames:
            return frames[0]
    return ""


def in_torch(filename: str) -> bool:
    """``filename`` is torch's own code (under its package folder)."""
    return os.path.abspath(filename).startswith(os.path.dirname(torch.__file__) + os.sep)


def shown_path(path: str) -> str:
    """The name a message gives ``path``: an installed package's file by its path inside the
    packages folder (``litgpt/model.py``, ``einops/_torch_specific.py``), so that it is not
    taken for the user's own ``model.py``; any other file by its base name."""
    parts = _PACKAGES.split(path)
    return parts[-1].replace(os.sep, "/") if len(parts) > 1 else os.path.basename(path)


@functools.lru_cache(maxsize=None)
def _source_file(path: str) -> bool:
    """``path`` is a file a user can open: not code generated at run time (exec'd or
    compiled code whose file exists nowhere)."""
    return os.path.isfile(path)
