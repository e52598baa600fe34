"""Shared fixtures of the distributed and end-to-end tests: the real ``parallelize`` CLI and
``torchrun``, each in a subprocess, and a session-wide cache of compiled programs.

A compile takes seconds on CPU, so each (example, overrides) pair is compiled once per
session, and the pairs named by ``@pytest.mark.precompile(example, *overrides)`` on the
selected tests are compiled ahead in one background thread: a compile (one process) then
overlaps the torchrun of the test before it instead of adding to it.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import warm

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# One intra-op thread per rank: CI has fewer cores than ranks, and oversubscription makes
# the gloo runs several times slower.
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# PZ_TESTS_COLD=1: fresh interpreters for every compile and run (as a user runs them), slower
COLD = os.environ.get("PZ_TESTS_COLD") == "1"

_ERR = re.compile(r"^verify: (loss|outputs|gradients|parameters)\b.*max abs err (\S+)$", re.M)
_STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)

# torch 2.13 + gloo: a process that built a DeviceMesh and ran a collective sometimes aborts
# in interpreter shutdown, after destroy_process_group() (reported to the lead).
def pytest_configure(config):
    config.addinivalue_line("markers", "precompile(example, *overrides): compile this "
                            "example with these overrides ahead, in the background")


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def explain(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"


def mesh_overrides(dp: int = 1, tp: int = 1, pp: int = 1) -> tuple[str, ...]:
    """Every mesh dim explicitly: the example specs set their own."""
    return (f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}")


def parallelize(model: Path, spec: Path, out: Path, *args: str, timeout: float = 240) -> Result:
    """``python -m parallelizer MODEL SPEC -o OUT ARGS...``: the command's ``main`` in a process
    forked from the warm server (tests/warm.py), or a fresh interpreter under PZ_TESTS_COLD=1."""
    argv = [str(model), str(spec), "-o", str(out), *args]
    if COLD:
        p = subprocess.run([sys.executable, "-m", "parallelizer", *argv], capture_output=True,
                           text=True, env=_ENV, cwd=REPO, timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)
    return _warm("parallelizer.cli.parallelize:main", (argv,), _ENV, REPO, timeout)


def _warm(entry, args, env, cwd, timeout, nproc=None) -> Result:
    return _Started(entry, args, env, cwd, timeout, nproc).wait()


class _Started:
    """A warm launch in flight (tests/warm.py); ``wait()`` gives its Result."""

    def __init__(self, entry, args, env, cwd, timeout, nproc=None):
        self.logs = Path(tempfile.mkdtemp(prefix="pz-warm-"))
        self.launch = warm.start(entry, args, env, cwd, self.logs, timeout, nproc)

    def wait(self) -> Result:
        try:
            return Result(*self.launch.wait())
        finally:
            shutil.rmtree(self.logs, ignore_errors=True)


class _Cold:
    """A real torchrun (or python) subprocess in flight; ``wait()`` gives its Result."""

    def __init__(self, cmd, env, cwd, timeout):
        self.timeout = timeout
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=cwd)

    def wait(self) -> Result:
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        finally:
            self.proc.kill()
        return Result(self.proc.returncode, out, err)


def launch(script: Path, nproc: int | None, *args: str, timeout: float = 280, cwd: Path = REPO,
           env=None):
    """Start a test's driver script: ``torchrun --nproc-per-node NPROC SCRIPT ARGS...`` (or
    ``python SCRIPT ARGS...`` when ``nproc`` is None) as ranks forked from the warm server, or
    as the real subprocess under PZ_TESTS_COLD=1. Returns a handle; ``.wait()`` -> Result."""
    env = {**_ENV, "PYTHONPATH": str(REPO), **(env or {})}
    args = [str(a) for a in args]
    if not COLD:
        return _Started("warm:run_script", (str(script), args), env, cwd, timeout, nproc)
    runner = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                       "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return _Cold([sys.executable, *runner, str(script), *args], env, cwd, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, nproc: int, *args: str, timeout: float = 240, launcher=(),
             env=None) -> Result:
    """``torchrun --nproc-per-node NPROC OUT/run.py --device cpu ARGS...`` (gloo, fp32): the
    function run.py calls, in NPROC ranks forked from the warm server with torchrun's
    environment on a fresh port (tests/warm.py). ``launcher`` (torchrun's own options, such as
    ``--max-restarts``) or PZ_TESTS_COLD=1 runs the real torchrun; ``env`` adds variables."""
    argv = ["--device", "cpu", *args]
    env = {**_ENV, **(env or {})}
    if launcher or COLD:
        return real_torchrun(out, nproc, *args, timeout=timeout, launcher=launcher, env=env)
    return _warm("parallelizer.runtime.main:_main", (out.resolve(), argv), env, out.parent,
                 timeout, nproc)


def real_torchrun(out: Path, nproc: int, *args: str, timeout: float = 240, launcher=(),
                  env=None) -> Result:
    """The real ``torchrun`` in a subprocess, for what torchrun itself does (restarts, its
    rendezvous): an agent and NPROC fresh interpreters."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *launcher,
           str(out / "run.py"), "--device", "cpu", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**_ENV, **(env or {})},
                       cwd=out.parent, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def run_command(cmd: list[str], env: dict, cwd: Path = REPO, timeout: float = 600) -> Result:
    """``[python, -m, parallelizer, ARGS...]`` (the ``parallelize`` command) or ``[python, -m,
    torch.distributed.run, --nproc-per-node N, ..., -m, MODULE, ARGS...]`` (a module under
    torchrun), as the benchmarks' helpers build them (benchmarks/_common.py), in processes
    forked from the warm server: the command's ``main``, or N ranks of ``python -m MODULE``
    with torchrun's environment (tests/warm.py). Any other command runs as it is."""
    cmd = [str(c) for c in cmd]
    if cmd[1:3] == ["-m", "parallelizer"] and not COLD:
        return _warm("parallelizer.cli.parallelize:main", (cmd[3:],), env, cwd, timeout)
    if cmd[1:3] == ["-m", "torch.distributed.run"] and "-m" in cmd[3:] and not COLD:
        launcher, (module, *argv) = cmd[3:cmd.index("-m", 3)], cmd[cmd.index("-m", 3) + 1:]
        nproc = int(launcher[launcher.index("--nproc-per-node") + 1])
        return _warm("warm:run_module", (module, argv), env, cwd, timeout, nproc)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def check_exit(res: Result) -> None:
    """Exit 0, checked last (after the output). run.py leaves with os._exit since gloo's
    threads aborted one run in five at interpreter teardown; a regression fails here."""
    assert res.code == 0, res.explain()


def verify_errors(stdout: str) -> dict[str, float]:
    """The four ``max abs err`` figures of ``run.py --verify``: category -> float."""
    return {cat: float(v) for cat, v in _ERR.findall(stdout)}


def step_losses(stdout: str) -> list[float]:
    """The ``step N loss X`` lines of ``run.py --train`` (rank 0), in order."""
    steps = _STEP.findall(stdout)
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1)), stdout
    return [float(x) for _, x in steps]


class Compiled:
    """``compiled(example, *overrides) -> OUT``, compiled once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._futures: dict[tuple, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="precompile")

    def _out(self, key) -> Path:
        return self.root / f"{key[0]}-{len(self._futures)}"

    def prefetch(self, example: str, *overrides: str) -> None:
        key = (example, tuple(overrides))
        if key not in self._futures:
            out = self._out(key)
            self._futures[key] = self._pool.submit(self._compile, example, overrides, out)

    @staticmethod
    def _compile(example, overrides, out) -> tuple[Path, Result]:
        return out, parallelize(EXAMPLES / example / "model.py",
                                EXAMPLES / example / "spec.yaml", out, *overrides)

    def __call__(self, example: str, *overrides: str) -> Path:
        self.prefetch(example, *overrides)
        out, res = self._futures[(example, tuple(overrides))].result()
        assert res.code == 0, res.explain()
        return out

    def close(self) -> None:
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def compiled(request, tmp_path_factory):
    """The session's :class:`Compiled`; treat each OUT as read-only (copy it to tamper).
    Starts compiling, in test order, every pair named by a ``precompile`` mark of the
    selected tests."""
    cache = Compiled(tmp_path_factory.mktemp("compiled"))
    for item in request.session.items:
        for mark in item.iter_markers("precompile"):
            cache.prefetch(*mark.args)
    yield cache
    cache.close()


class Tools:
    """The helpers above, handed to tests as the ``tools`` fixture (test modules do not
    import conftest)."""
    repo = REPO
    examples = EXAMPLES
    mesh = staticmethod(mesh_overrides)
    parallelize = staticmethod(parallelize)
    torchrun = staticmethod(torchrun)
    real_torchrun = staticmethod(real_torchrun)
    launch = staticmethod(launch)
    run_command = staticmethod(run_command)
    check_exit = staticmethod(check_exit)
    verify_errors = staticmethod(verify_errors)
    step_losses = staticmethod(step_losses)


@pytest.fixture(scope="session")
def tools() -> type[Tools]:
    return Tools


@pytest.fixture
def in_place_kept(monkeypatch):
    """Capture keeps the model's in-place writes as written. It spells a write into the
    forward's own unaliased tensor out of place (frontend/capture.py ``_out_of_place``); the
    tests using this are of the planner meeting one (a write into a sharded value, which no
    gathered copy can stand in for)."""
    from parallelizer.frontend import capture
    monkeypatch.setattr(capture, "_out_of_place", lambda node, order: False)
