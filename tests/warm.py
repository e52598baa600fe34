"""Run the project's entry points in processes forked from one warm server.

A ``torchrun`` of ``OUT/run.py`` starts an agent and ``nproc`` fresh interpreters, each of which
imports torch, transformers and parallelizer again: about 10 s of CPU per launch on the 2-core
CI machine before the first collective, most of the suite's time. Here one
``multiprocessing`` forkserver imports them once per session, and each rank (or compile) is a
fork of it: the same entry function ``run.py`` calls (:func:`parallelizer.runtime.main._main`,
or the ``parallelize`` command's ``main``), the same environment variables torchrun sets
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), real processes and real gloo
process groups, each rank's stdout and stderr in its own file. Tests of what torchrun itself
does (restarts, ``--max-restarts``, launch.sh) still launch torchrun.

The server never runs a torch op before forking (libgomp's thread pool does not survive a
fork), and every child starts from the server's state, so no test sees another's modules.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.export", "transformers", "transformers.modeling_utils",
           "transformers.modeling_outputs", "parallelizer.runtime.main", "parallelizer.compiler",
           "parallelizer.cli.parallelize"]
_CONTEXT = None


def context():
    """The session's forkserver context (started on first use)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(entry: str, args: tuple, env: dict, cwd: str, log: str) -> None:
    for fd, path in ((1, log), (2, log + ".err")):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # a driver may leave by os._exit
    os.environ.update(env)
    os.chdir(cwd)
    code = 1
    try:
        import torch
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        module, func = entry.split(":")
        code = getattr(importlib.import_module(module), func)(*args)
        code = 0 if code is None else int(code)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(path: str, argv: list) -> int:
    """Run the script ``path`` as ``__main__`` with ``sys.argv = [path, *argv]`` (a test's
    torchrun driver)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))
    runpy.run_path(path, run_name="__main__")
    return 0


def run_module(module: str, argv: list) -> int:
    """Run ``module`` as ``__main__`` with ``sys.argv = [module, *argv]`` (``python -m MODULE``,
    a benchmark's worker under torchrun)."""
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


class Launch:
    """Processes started by :func:`start`; :meth:`wait` collects them."""

    def __init__(self, procs, logs: Path, timeout: float):
        self.procs, self.logs = procs, logs
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout

    def wait(self) -> tuple[int, str, str]:
        """(exit code: 0, or the first non-zero one in rank order, -9 on timeout; the stdout
        of the processes in rank order; their stderr likewise)."""
        for p in self.procs:
            p.join(max(0.0, self.deadline - time.monotonic()))
        late = [p for p in self.procs if p.exitcode is None]
        for p in late:
            p.kill()
            p.join()
        codes = [p.exitcode for p in self.procs]
        n = range(len(self.procs))
        out = "".join((self.logs / f"rank{r}").read_text() for r in n)
        err = "".join((self.logs / f"rank{r}.err").read_text() for r in n)
        if late:
            return -9, out, err + f"\ntimed out after {self.timeout} s (exit codes {codes})"
        return next((c for c in codes if c), 0), out, err


def start(entry: str, args: tuple, env: dict, cwd: Path, logs: Path, timeout: float,
          nproc: int | None = None) -> Launch:
    """``entry`` (``"module:function"``) called with ``args`` in one forked process, or in
    ``nproc`` forked ranks with torchrun's environment variables on a fresh port."""
    ctx = context()
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(nproc or 1):
        rank_env = env if nproc is None else {
            **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}
        p = ctx.Process(target=_child, args=(entry, args, rank_env, str(cwd), str(logs / f"rank{rank}")))
        p.start()
        procs.append(p)
    return Launch(procs, logs, timeout)
