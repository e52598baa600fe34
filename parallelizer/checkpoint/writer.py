"""Write a state_dict resharded for a ParallelPlan: one safetensors file per (pipeline
stage, tp rank) plus ``manifest.json``, in the format of :mod:`parallelizer.checkpoint.format`
(docs/checkpoints.md). :class:`FileLayout` is what decides those files: the mesh and every stored
tensor's placement.

The write is atomic (:mod:`parallelizer.checkpoint.publish`): everything goes to a hidden
sibling folder, is fsynced, then renamed onto ``out_dir``; a reader never sees a partial
checkpoint.
"""
from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from parallelizer.checkpoint.format import (FORMAT_VERSION, MANIFEST, dtype_name, layout_hash,
                                            optim_name, shard_file_name)
from parallelizer.checkpoint.publish import (check_destination, fsync_dir, fsync_file, publish,
                                             temp_sibling, write_synced)
from parallelizer.checkpoint.slicing import local_piece, normalize_dim
from parallelizer.checkpoint.stream import write_streamed
from parallelizer.errors import CheckpointError
from parallelizer.plan.layouts import layout_json, segments
from parallelizer.plan.parallel_plan import ParallelPlan, TensorPlan


@dataclass
class FileLayout:
    """Everything that decides a checkpoint's files, one per (stage, tp rank): the mesh,
    every stored tensor's placement (optimizer state entries carry their parameter's; its tp
    layout is ``TensorPlan.layout``), tied aliases and the pipeline structure that lets a
    resharder re-partition it (ParallelPlan.structure)."""

    mesh: dict
    tensors: dict                                  # name -> TensorPlan (fqn == name)
    params: dict = field(default_factory=dict)     # optimizer state name -> parameter fqn
    aliases: dict = field(default_factory=dict)
    structure: dict = field(default_factory=dict)
    plan_hash: str = ""
    train: Optional[dict] = None
    num_stages: Optional[int] = None               # pp x virtual stages; None: mesh["pp"]

    @staticmethod
    def from_plan(plan: ParallelPlan, optim_names: dict = None, train: Optional[dict] = None,
                  dtypes: Optional[dict] = None) -> "FileLayout":
        """The plan's layout; ``optim_names``: optimizer state name -> parameter fqn;
        ``dtypes``: optimizer state name -> dtype name (default the parameter's)."""
        tensors = dict(plan.tensors)
        params = dict(optim_names or {})
        for name, fqn in params.items():
            tensors[name] = optim_entry(plan.tensors[fqn], name, (dtypes or {}).get(name))
        return FileLayout(dict(plan.mesh), tensors, params, dict(plan.aliases),
                          dict(plan.structure), plan.hash(), train, plan.num_stages)

    def model_tensors(self) -> dict:
        return {k: v for k, v in self.tensors.items() if k not in self.params}

    def stages(self) -> int:
        """Number of pipeline stages (one file per stage and tp rank)."""
        return self.num_stages or self.mesh["pp"]

    def layout_hash(self) -> str:
        return layout_hash(self.stages(), self.mesh["tp"], self.model_tensors())

    def files(self) -> list[tuple[int, int]]:
        """(stage, tp rank) of every file."""
        return [(p, t) for p in range(self.stages()) for t in range(self.mesh["tp"])]

    def file_specs(self, p: int, t: int) -> list[tuple[str, tuple, torch.dtype]]:
        """(name, local shape, dtype) of every tensor stored in file (p, t), in file order."""
        tp = self.mesh["tp"]
        return [(name, tuple(tplan.local_shape(tp)), getattr(torch, tplan.dtype))
                for name, tplan in sorted(self.tensors.items()) if p in tplan.stages]


def optim_entry(param: TensorPlan, name: str, dtype: Optional[str] = None) -> TensorPlan:
    """Placement of optimizer state ``name`` of ``param``: the parameter's, except ``step``
    (a 0-d counter, replicated); ``dtype`` default: the parameter's (fp32 for ``step``)."""
    if name.endswith(".step"):
        return replace(param, fqn=name, shape=(), dtype=dtype or "float32", tp_dim=None,
                       layout=None, is_buffer=True, role="replicate")
    return replace(param, fqn=name, dtype=dtype or param.dtype)


def write_checkpoint(state_dict: dict[str, torch.Tensor], plan: ParallelPlan, out_dir: Path,
                     overwrite: bool = False, optim_state: Optional[dict] = None,
                     train: Optional[dict] = None) -> Path:
    """Write ``state_dict`` in the plan's (stage, tp) layout to ``out_dir``.

    Args:
        state_dict: canonical fqn -> full tensor (shape and dtype as in the plan); entries
            under alias fqns of ``plan.aliases`` are ignored.
        plan: the ParallelPlan; ``plan.num_stages`` and tp give the files, ``plan.tensors``
            the placements.
        out_dir: destination folder; must not exist or be empty unless ``overwrite``.
        overwrite: replace an existing non-empty ``out_dir``, only once the new one is complete.
        optim_state: optional ``{fqn: {"exp_avg", "exp_avg_sq", "step"}}`` full tensors
            (AdamW state gathered to full shape), stored in the parameter's layout.
        train: optional ``{"step": int, "optimizer": name}`` recorded in the manifest.

    Returns:
        ``out_dir``.

    Peak memory: the state_dict plus one tp piece.

    Raises:
        CheckpointError: ``out_dir`` exists and is not empty (without ``overwrite``) or is a
            file; a plan tensor is missing from ``state_dict`` or has another shape or dtype;
            ``state_dict`` holds tensors the plan does not know.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite)
    _check_state_dict(state_dict, plan)
    full = dict(state_dict)
    names = {}
    for fqn, states in sorted((optim_state or {}).items()):
        for state, t in states.items():
            names[optim_name(fqn, state)] = fqn
            full[optim_name(fqn, state)] = t
    layout = FileLayout.from_plan(plan, names, train, {n: dtype_name(full[n].dtype) for n in names})
    tp = plan.mesh["tp"]

    def piece(name: str, t_rank: int) -> torch.Tensor:
        return local_piece(full[name], layout.tensors[name], tp, t_rank)

    return write_layout(layout, piece, out_dir, overwrite)


def write_layout(layout: FileLayout, piece: Callable[[str, int], torch.Tensor], out_dir: Path,
                 overwrite: bool = False, progress: Optional[Callable[[int], None]] = None,
                 tmp_hook: Optional[Callable[[Path], None]] = None,
                 pool: Optional[Executor] = None, checks: Sequence[Callable[[], None]] = ()) -> Path:
    """Write every file of ``layout`` (``piece(name, tp_rank)`` gives each local piece) and
    the manifest into a hidden temporary sibling of ``out_dir``, fsync, then rename it onto
    ``out_dir``. ``progress(nbytes)`` is called after each piece; ``tmp_hook(tmp)`` once
    the temporary folder exists. On any error (or a kill) nothing exists at ``out_dir``
    that was not there before; a killed process leaves only ``.<name>.tmp-*``.

    ``checks`` (e.g. the input files' sha256) must all pass before anything is published;
    their errors take precedence over the writes' (in ``checks`` order), since what is
    written derives from what they check. Without a ``pool`` they run first, then the files
    one after another. With a thread ``pool`` the files are written in parallel, largest
    first (``piece`` must be thread-safe), the checks queued after them so that the files'
    fsyncs (in one extra thread that mostly waits on the disk) overlap them; pieces produced
    and not yet written never exceed 2 x the largest piece in bytes, so peak memory stays
    that of two pieces whatever the number of threads.

    Raises:
        CheckpointError: ``out_dir`` is not a folder or not empty (without ``overwrite``);
            whatever a check or ``piece`` raises.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out_dir)
    jobs: list[Future] = []
    syncer = ThreadPoolExecutor(1, thread_name_prefix="fsync") if pool is not None else None
    try:
        if tmp_hook is not None:
            tmp_hook(tmp)
        sizes = {pt: [_nbytes(s, dt) for _, s, dt in layout.file_specs(*pt)] for pt in layout.files()}
        budget = _Budget(2 * max((n for v in sizes.values() for n in v), default=0))
        meta_hash = layout.layout_hash()

        def write_file(p: int, t: int) -> tuple[str, dict, Optional[Future]]:
            name = shard_file_name(p, t)
            meta = {"format": "pt", "layout_hash": meta_hash, "stage": str(p), "tp_rank": str(t)}
            specs = layout.file_specs(p, t)
            nbytes = {n: _nbytes(s, dt) for n, s, dt in specs}
            held = [0]

            def produce(n):
                budget.release(held[0])  # the previous piece of this file is written
                held[0] = budget.acquire(nbytes[n]) if pool is not None else 0
                out = piece(n, t)
                if progress is not None:
                    progress(out.numel() * out.element_size())
                return out

            try:
                digest, size = write_streamed(tmp / name, specs, produce, meta, fsync=syncer is None)
            finally:
                budget.release(held[0])
                held[0] = 0
            synced = syncer.submit(fsync_file, tmp / name) if syncer is not None else None
            return name, {"sha256": digest, "bytes": size}, synced

        if pool is None:
            for check in checks:
                check()
            written = [write_file(p, t) for p, t in layout.files()]
        else:
            order = sorted(layout.files(), key=lambda pt: -sum(sizes[pt]))
            jobs = [pool.submit(write_file, p, t) for p, t in order]
            gates = [pool.submit(check) for check in checks]
            written = _results(jobs, gates)
        for *_, synced in written:
            if synced is not None:
                synced.result()
        manifest = build_manifest(layout, {name: entry for name, entry, _ in sorted(written)})
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        publish(tmp, out_dir, overwrite)
    except BaseException:
        for j in jobs:  # no thread may still be writing into tmp while it is removed
            j.cancel()
        wait(jobs)
        if syncer is not None:
            syncer.shutdown(wait=True)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if syncer is not None:
            syncer.shutdown(wait=True)
    return out_dir


def _results(jobs: list[Future], gates: list[Future]) -> list:
    """Results of ``jobs`` once they and ``gates`` are done; on the first failure of either,
    the pending jobs are cancelled and the first failed gate's error (else a job's) raised."""
    done, _ = wait(jobs + gates, return_when=FIRST_EXCEPTION)
    if any(f.exception() is not None for f in done):
        for j in jobs:
            j.cancel()
        wait(jobs)
    wait(gates)  # a corrupt input explains any failure of a piece derived from it
    for f in gates + jobs:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    return [j.result() for j in jobs]


def _nbytes(shape, dtype: torch.dtype) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


class _Budget:
    """Bytes of pieces produced and not yet written, across writer threads: ``acquire(n)``
    blocks until ``n`` fits under ``limit`` (a piece larger than ``limit`` waits for an
    empty budget, then goes alone); a thread holds at most one piece while waiting, so
    this cannot deadlock."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        with self.cond:
            self.cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    def release(self, n: int) -> None:
        if n:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_manifest(layout: FileLayout, files: dict) -> dict:
    """The manifest dict of ``layout`` given ``files`` (file name -> {sha256, bytes})."""
    tp = layout.mesh["tp"]
    tensors = {}
    for name, tplan in sorted(layout.tensors.items()):
        d = normalize_dim(tplan.tp_dim, len(tplan.shape))
        pieces = []
        for p in sorted(set(tplan.stages)):
            for t in range(tp):
                segs = None if d is None else [
                    list(s) for s in segments(tplan.shape[d], tplan.layout, tp, t) if s.length]
                pieces.append({"file": shard_file_name(p, t), "name": name, "tp_rank": t, "stage": p,
                               "shape": list(tplan.local_shape(tp)), "segments": segs})
        entry = {"shape": list(tplan.shape), "dtype": tplan.dtype, "is_buffer": tplan.is_buffer,
                 "role": tplan.role, "tp_dim": d, "layout": layout_json(tplan.layout),
                 "stages": list(tplan.stages), "pieces": pieces,
                 "kind": "optim" if name in layout.params else "model"}
        if name in layout.params:
            entry["param"] = layout.params[name]
        tensors[name] = entry
    out = {"format_version": FORMAT_VERSION, "plan_hash": layout.plan_hash,
           "layout_hash": layout.layout_hash(), "mesh": dict(layout.mesh),
           "num_stages": layout.stages(), "tensors": tensors,
           "aliases": dict(sorted(layout.aliases.items())), "structure": layout.structure,
           "files": files}
    if layout.train is not None:
        out["train"] = layout.train
    return out


def _check_state_dict(state_dict: dict, plan: ParallelPlan) -> None:
    """Every plan tensor present with the plan's shape and dtype; nothing unknown besides aliases."""
    missing = sorted(set(plan.tensors) - set(state_dict))
    unknown = sorted(set(state_dict) - set(plan.tensors) - set(plan.aliases))
    wrong = [f"{fqn}: plan {tplan.shape} {tplan.dtype} vs tensor "
             f"{tuple(state_dict[fqn].shape)} {dtype_name(state_dict[fqn].dtype)}"
             for fqn, tplan in sorted(plan.tensors.items()) if fqn in state_dict
             and not _agrees(state_dict[fqn], tplan)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} plan tensor(s) missing from the state_dict: {_few(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} state_dict tensor(s) not in the plan: {_few(unknown)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) differ from the plan: {_few(wrong)}")
    if problems:
        raise CheckpointError("cannot write checkpoint: " + "; ".join(problems)
                              + "; the state_dict must be keyed by the plan's canonical fqns")
    for fqn, tplan in plan.tensors.items():
        tplan.local_shape(plan.mesh["tp"])  # ValueError: a layout the planner should have refused
        assert tplan.stages and all(0 <= p < plan.num_stages for p in tplan.stages), (
            f"{fqn}: stages {tplan.stages} not in [0, {plan.num_stages})")


def _agrees(tensor: torch.Tensor, tplan: TensorPlan) -> bool:
    return tuple(tensor.shape) == tuple(tplan.shape) and dtype_name(tensor.dtype) == tplan.dtype


def _few(items: list, n: int = 5) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")
