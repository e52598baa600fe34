"""Hugging Face format out of and into parallelizer checkpoints: ``parallelize export`` and
``parallelize import``.

Export writes the original model's ``state_dict`` names (``structure["state_dict_keys"]``
recorded at compile time, tied aliases included, non-persistent buffers excluded) with the
stored dtypes and full shapes: ``model.safetensors``, or above ``--max-shard-size``
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {name: file}}``), as ``transformers``
``save_pretrained`` writes them. Vocabulary padding is never exported (only the runs of real
rows are read). Import reads either format into a compiled program's layout, streaming
like reshard: the Hugging Face files are indexed by their headers, each output piece is
read from its (lazily mapped) tensor and cast alone, and the files are written in parallel,
so peak memory is about two pieces, never the model.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from parallelizer.checkpoint.hf import (INDEX_FILE, SINGLE_FILE, HFTensor, load_hf_state_dict,
                                        match_to_model)
from parallelizer.checkpoint.slicing import local_piece
from parallelizer.checkpoint.reader import load_tensor, read_manifest
from parallelizer.convert.reshard import check_paths, cores, progress_bar, verify_all
from parallelizer.checkpoint.stream import write_streamed
from parallelizer.convert.target import target_layout
from parallelizer.checkpoint.publish import fsync_dir, publish, temp_sibling, write_synced
from parallelizer.checkpoint.writer import FileLayout, build_manifest, write_layout
from parallelizer.errors import CheckpointError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (GB = 10^9, GiB = 2^30, as transformers).

    Raises:
        CheckpointError: not a number with one of the units B, KB, MB, GB, TB, KiB..TiB.
    """
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise CheckpointError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def stacked_members(manifest_or_structure: dict) -> dict:
    """Expert FQN -> (stacked FQN, its index) for experts the compiler stacked
    (passes/stack_experts.py; ``structure["stacked"]``), empty otherwise."""
    structure = manifest_or_structure.get("structure", manifest_or_structure) or {}
    return {m: (fqn, i) for fqn, members in (structure.get("stacked") or {}).items()
            for i, m in enumerate(members)}


def export_names(manifest: dict) -> list[tuple[str, str]]:
    """``(state_dict name, stored fqn)`` in the original state_dict order; an expert the
    compiler stacked is stored as its stacked tensor (:func:`stacked_members`). A key the
    checkpoint does not hold (:func:`unread_keys`) is left out."""
    return [(k, fqn) for k, fqn in _stored_as(manifest) if fqn in manifest["tensors"]]


def unread_keys(manifest: dict) -> list[str]:
    """The model's state_dict keys the checkpoint does not hold: tensors its forward never
    reads (a frozen BatchNorm's ``num_batches_tracked``, a pooler whose output is not
    returned), which the plan leaves out (planning/tensors.py: only what a stage reads)."""
    return [k for k, fqn in _stored_as(manifest) if fqn not in manifest["tensors"]]


def _stored_as(manifest: dict) -> list[tuple[str, str]]:
    """``(state_dict name, the fqn it is stored as)`` for every key of the model."""
    aliases = manifest.get("aliases", {})
    stacked = stacked_members(manifest)
    keys = (manifest.get("structure") or {}).get("state_dict_keys")
    if keys is None:  # checkpoints of plans compiled before the keys were recorded
        model = [k for k, e in manifest["tensors"].items() if e.get("kind", "model") == "model"]
        keys = sorted(model + list(aliases))
    return [(k, stacked[k][0] if k in stacked else aliases.get(k, k)) for k in keys]


def export_hf(src, dst, max_shard_size: str = "5GB", force: bool = False,
              show_progress: bool = False) -> list[str]:
    """Write checkpoint ``src`` to folder ``dst`` in Hugging Face safetensors format.

    Returns:
        the file names written.

    Raises:
        CheckpointError: bad paths, SRC corrupt or incomplete, a bad size.
    """
    src, dst = Path(src), Path(dst)
    limit = parse_size(max_shard_size)
    manifest = read_manifest(src)
    check_paths(src, dst, force)
    verify_all(src, manifest, show_progress)
    names = export_names(manifest)
    stacked = stacked_members(manifest)
    shapes = {k: tuple(manifest["tensors"][f]["shape"])[1 if k in stacked else 0:] for k, f in names}
    sizes = {k: _nbytes(manifest["tensors"][f], shapes[k]) for k, f in names}
    shards: list[list[str]] = [[]]
    acc = 0
    for k, _ in names:  # transformers' greedy split: a new shard when the next would overflow
        if shards[-1] and acc + sizes[k] > limit:
            shards.append([])
            acc = 0
        shards[-1].append(k)
        acc += sizes[k]
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    fqn_of = dict(names)

    def write(tmp: Path, bar) -> None:
        for file, keys in zip(files, shards):
            specs = [(k, shapes[k], getattr(torch, manifest["tensors"][fqn_of[k]]["dtype"]))
                     for k in keys]
            last: dict = {}  # the stacked tensor its experts are read from, loaded once

            def produce(k):
                if k not in stacked:
                    t = load_tensor(src, fqn_of[k], manifest=manifest)
                else:
                    if fqn_of[k] not in last:
                        last.clear()
                        last[fqn_of[k]] = load_tensor(src, fqn_of[k], manifest=manifest)
                    t = last[fqn_of[k]][stacked[k][1]].clone()
                bar.update(t.numel() * t.element_size())
                return t

            write_streamed(tmp / file, specs, produce, {"format": "pt"})
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {k: f for f, keys in zip(files, shards) for k in keys}}
            write_synced(tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())

    with progress_bar(sum(sizes.values()), "export", show_progress) as bar:
        _atomic_folder(dst, force, lambda tmp: write(tmp, bar))
    return files + ([INDEX_FILE] if n > 1 else [])


def import_hf(hf_path, dst, plan, tp: Optional[int] = None, pp: Optional[int] = None,
              buffers_from: Optional[Path] = None, force: bool = False) -> Path:
    """Write a Hugging Face checkpoint (file, folder or index) in the layout of ``plan``
    (a compiled program's ParallelPlan), or of that plan re-laid out for (``tp``, ``pp``).

    Names are matched as the compiler's ``checkpoint.path`` does (one leading prefix, tied
    aliases, harmless leftovers such as ``embeddings.position_ids``); tensors are cast to
    the plan's dtype piece by piece (peak memory: about two pieces, never the model).
    Non-persistent buffers (absent from Hugging Face files) are taken from ``buffers_from``
    (the program's ``OUT/checkpoint``).

    Raises:
        CheckpointError: names that do not match, shapes that differ, non-persistent buffers
            without ``buffers_from``; bad paths.
    """
    dst = Path(dst)
    check_paths(Path(hf_path), dst, force)
    keys = plan.structure.get("state_dict_keys") or list(plan.tensors)
    stacked = stacked_members(plan.structure)
    stored = [k for k in keys if plan.aliases.get(k, k) in plan.tensors or k in stacked]
    shapes = {k: plan.tensors[stacked[k][0]].shape[1:] if k in stacked else
              plan.tensors[plan.aliases.get(k, k)].shape for k in stored}
    matched = match_to_model(load_hf_state_dict(hf_path, lazy=True), stored, plan.aliases, shapes)
    state = {plan.aliases.get(k, k): v for k, v in matched.items() if k not in stacked}
    for fqn, members in (plan.structure.get("stacked") or {}).items():  # experts stacked again
        state[fqn] = torch.stack([_read(matched[m]) for m in members])
    rest = sorted(set(plan.tensors) - set(state))
    if rest:
        if buffers_from is None or not (Path(buffers_from) / "manifest.json").exists():
            raise CheckpointError(
                f"{len(rest)} tensor(s) of the plan are not in a Hugging Face state_dict "
                f"(non-persistent buffers): {rest[:5]}; pass a program folder compiled with "
                "weights (its OUT/checkpoint provides them)")
        bman = read_manifest(buffers_from)
        for fqn in rest:
            state[fqn] = load_tensor(buffers_from, fqn, manifest=bman)
    layout = FileLayout.from_plan(plan)
    if tp or pp:
        layout = target_layout(build_manifest(layout, {}), tp or plan.mesh["tp"], pp or plan.mesh["pp"])

    def piece(name: str, t: int) -> torch.Tensor:
        # the full tensor is a lazy mapping: only the piece's rows are read, cast as copied
        full = _read(state[name])
        tplan = layout.tensors[name]
        return local_piece(full, tplan, layout.mesh["tp"], t, getattr(torch, tplan.dtype))

    with ThreadPoolExecutor(cores(), thread_name_prefix="import") as pool:
        return write_layout(layout, piece, dst, overwrite=force, pool=pool)


def _read(t) -> torch.Tensor:
    return t.read() if isinstance(t, HFTensor) else t


def _nbytes(entry: dict, shape=None) -> int:
    n = torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()
    for s in entry["shape"] if shape is None else shape:
        n *= s
    return n


def _atomic_folder(dst: Path, force: bool, fill) -> None:
    """``fill(tmp)`` a hidden temporary sibling of ``dst``, then rename it onto ``dst``."""
    import shutil
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dst)
    try:
        fill(tmp)
        fsync_dir(tmp)
        publish(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
