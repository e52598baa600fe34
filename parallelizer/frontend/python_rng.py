"""Draws from Python's or NumPy's random generators while the model is captured.

Capture runs ``forward`` once and records the ops it ran; a Python-level draw is not an op,
so its outcome that one time is frozen into the program. x-transformers' layer dropout
(``if self.training and random() < layer_dropout: continue``) skipped some blocks in the
captured run: the program never runs them, the model runs each in most steps (zoo 13 Z10;
the pipeline split then failed with an internal error, and a capture that happened to skip
none would have passed, then trained another model). torch's own random ops are ops, and
the program draws them (docs/tensor-parallel.md, dropout).

The draw is found by the generators' states (before and after export), whatever the
spelling (``from random import random``, ``np.random.rand``), and its line by running the
model once more under ``sys.settrace``: the first line of the model's code after which the
states differ.
"""
from __future__ import annotations

import contextlib
import random
import sys
from pathlib import Path

import torch

from ..errors import CaptureError
from .module_state import buffer_values_kept, state_kept

_STDLIB_RANDOM = random.__file__


def snapshot() -> tuple:
    """The states of Python's and (when imported) NumPy's global generators."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


def _drawn(before: tuple, after: tuple) -> bool:
    if before[0] != after[0]:
        return True
    a, b = before[1], after[1]
    return a is not None and b is not None and (a[2:] != b[2:] or (a[1] != b[1]).any())


@contextlib.contextmanager
def kept():
    """Python's and NumPy's generators as they were, after the block (an eager run the
    compiler makes: a type checker's draw in the model's forward)."""
    state = snapshot()
    try:
        yield
    finally:
        put_back(state)


def put_back(state: tuple) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        sys.modules["numpy"].random.set_state(state[1])


@contextlib.contextmanager
def no_draws(model: torch.nn.Module, args, kwargs, model_file: Path, hints=lambda: ""):
    """Raise CaptureError when the block draws from Python's or NumPy's generator (which
    is then put back as it was), naming the model's line that drew and ``hints()`` (the
    model's settings that draw: transformers' SpecAugment draws its masks with NumPy).

    Raises:
        CaptureError: the model's forward draws (its line and the fix).
    """
    before = snapshot()
    yield
    if not _drawn(before, snapshot()):
        return
    put_back(before)
    sites = _draw_sites(model, args, kwargs)
    if sites and all(checker for _, checker in sites):
        return  # a type checker's pick of which list item to check: no tensor sees it
    where = next((f" at {site}" for site, checker in sites if not checker), "")
    raise CaptureError(
        f"the model from {model_file} draws from Python's random module (or NumPy's) in "
        f"forward{where}: capture runs forward once, so that one draw would be frozen into "
        f"the program (a layer dropout by random() would skip the same blocks in every step, "
        f"or none).\nFix: set the option that draws to 0 (layer_dropout, stochastic depth), or "
        f"draw with torch (torch.rand(()) < p), which the program runs every step."
        + hints())


def _draw_sites(model, args, kwargs) -> list[tuple[str, bool]]:
    """``(FILE:LINE, by a type checker)`` of each line of one forward of ``model`` after
    which a generator's state changed (modules put back as they were): the line run last
    before the change, in the nearest frame that is not a generator's own code. A type
    checker's wrapper (beartype's generated ``<@beartype(...)>`` code, typeguard) draws to
    pick which item of a ``List[...]`` argument it checks (block-recurrent-transformer's
    forward, zoo 16 Z4): that draw reaches no tensor."""
    found: list = []
    start = snapshot()
    last = [start]
    line = [None]

    def trace(frame, event, arg):
        now = snapshot()
        if _drawn(last[0], now):
            found.append(line[0])
            last[0] = now
        if event == "line":
            line[0] = _site(frame)
        return trace

    traced_call(model, args, kwargs, trace)
    put_back(start)
    return [site for site in found if site is not None]


def traced_call(model, args, kwargs, trace) -> None:
    """One more call of ``model`` under ``sys.settrace(trace)``, for the line where something
    changed; the model (its modules, attributes, buffers' values) and torch's generator are
    left as they were, and an exception is ignored (the model ran once already)."""
    try:
        with state_kept(model), buffer_values_kept(model), torch.random.fork_rng(devices=[]), \
                torch.no_grad():
            sys.settrace(trace)
            try:
                model(*args, **kwargs)
            finally:
                sys.settrace(None)
    except Exception:  # noqa: BLE001  (the change is what matters)
        pass


def _site(frame) -> tuple[str, bool]:
    """The line ``frame`` runs, or its nearest caller's outside the generators' code; and
    whether that frame is a type checker's."""
    while frame is not None and _library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    checker = frame.f_code.co_filename.startswith("<@beartype(") or \
        name.split(".")[0] in ("beartype", "typeguard")
    return f"{frame.f_code.co_filename}:{frame.f_lineno}", checker


def _library(path: str) -> bool:
    """A generator's own code (random.py, NumPy), which the user did not write."""
    return path == _STDLIB_RANDOM or "/numpy/" in path
