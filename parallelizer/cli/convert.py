"""``parallelize reshard | export | import``: checkpoint conversions (registered in
parallelizer/cli/parallelize.py's SUBCOMMANDS)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallelizer.errors import CheckpointError


def load_plan(path: Path):
    """The ParallelPlan of a compiled program folder (OUT) or of a ``plan.json`` file.

    Raises:
        CheckpointError: neither exists.
    """
    from parallelizer.plan.parallel_plan import ParallelPlan
    file = Path(path) / "plan.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise CheckpointError(f"--plan {path}: no plan.json there; pass a folder written by "
                              "`parallelize MODEL SPEC -o OUT` (--no-weights is enough) or its plan.json")
    return ParallelPlan.from_json(file.read_text())


def _mesh_from_spec(path: Path) -> tuple[int, int, int]:
    from parallelizer.frontend.spec import load_spec
    spec = load_spec(path, [])
    return spec.mesh.tp, spec.mesh.pp, spec.pipeline.virtual_stages


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _destination(p: argparse.ArgumentParser, progress: bool = True) -> None:
    """The output options every conversion shares: -o DST, --force (and --no-progress)."""
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DST")
    p.add_argument("--force", action="store_true",
                   help="replace an existing DST (only once the new checkpoint is complete)")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def reshard_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="parallelize reshard",
        description="Convert a parallelizer checkpoint to another (tp, pp) layout, without the "
                    "model: the checkpoint's manifest carries placements and pipeline structure.")
    p.add_argument("src", type=Path, metavar="SRC", help="checkpoint folder (manifest.json)")
    _destination(p)
    p.add_argument("--tp", type=_positive, help="target tp degree (default: the source's)")
    p.add_argument("--pp", type=_positive, help="target pp degree (default: the source's)")
    p.add_argument("--virtual-stages", type=_positive, metavar="V",
                   help="pipeline stages per pp rank, as pipeline.virtual_stages (default: 1, or "
                        "the source's stages when pp is unchanged)")
    p.add_argument("--ep", type=_positive,
                   help="record the expert weights for this ep degree (default: the source's)")
    p.add_argument("--spec", type=Path,
                   help="take tp, pp and pipeline.virtual_stages from this spec")
    p.add_argument("--plan", type=Path, metavar="OUT",
                   help="exactly the layout of this compiled program (folder or plan.json)")
    ns = p.parse_args(argv)
    tp, pp, v, plan = ns.tp, ns.pp, ns.virtual_stages, None
    if ns.spec:
        tp, pp, v = _mesh_from_spec(ns.spec)
    if ns.plan:
        if ns.tp or ns.pp or ns.spec or ns.virtual_stages or ns.ep:
            raise CheckpointError("--plan gives the whole target layout; do not combine it with "
                                  "--tp/--pp/--virtual-stages/--spec/--ep")
        plan = load_plan(ns.plan)
    from parallelizer.convert.reshard import plural, reshard
    stats = reshard(ns.src, ns.out, tp, pp, plan, ns.force, show_progress=not ns.no_progress,
                    virtual_stages=v, ep=ns.ep)
    gb = stats["bytes_written"] / 1e9
    print(f"resharded {ns.src} -> {ns.out}: {plural(stats['files'], 'file')}, {gb:.3g} GB in "
          f"{stats['seconds']:.2f} s ({gb / max(stats['seconds'], 1e-9):.3g} GB/s)")
    return 0


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="parallelize export",
        description="Write a parallelizer checkpoint as a Hugging Face safetensors checkpoint "
                    "(model.safetensors, or shards + model.safetensors.index.json).")
    p.add_argument("src", type=Path, metavar="SRC")
    _destination(p)
    p.add_argument("--max-shard-size", default="5GB", help="shard above this size (default 5GB)")
    ns = p.parse_args(argv)
    from parallelizer.convert.export import export_hf, unread_keys
    files = export_hf(ns.src, ns.out, ns.max_shard_size, ns.force, not ns.no_progress)
    print(f"exported {ns.src} -> {ns.out}: {', '.join(files)}")
    from parallelizer.checkpoint.reader import read_manifest
    unread = unread_keys(read_manifest(ns.src))
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        print(f"not exported: {len(unread)} state_dict key(s) the model's forward never reads "
              f"({shown}): the checkpoint holds what the program reads; load the export with "
              f"load_state_dict(strict=False) to keep the model's own values of these")
    return 0


def import_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="parallelize import",
        description="Write a Hugging Face checkpoint in a compiled program's layout (or that "
                    "layout re-laid out for --tp/--pp).")
    p.add_argument("hf", type=Path, metavar="HF", help="model.safetensors, an index.json or their folder")
    _destination(p, progress=False)
    p.add_argument("--plan", type=Path, required=True, metavar="OUT",
                   help="compiled program folder (or plan.json) giving names and placements")
    p.add_argument("--tp", type=_positive)
    p.add_argument("--pp", type=_positive)
    ns = p.parse_args(argv)
    plan = load_plan(ns.plan)
    from parallelizer.convert.export import import_hf
    buffers = ns.plan / "checkpoint" if ns.plan.is_dir() else ns.plan.parent / "checkpoint"
    import_hf(ns.hf, ns.out, plan, ns.tp, ns.pp, buffers if buffers.exists() else None, ns.force)
    print(f"imported {ns.hf} -> {ns.out}", file=sys.stdout)
    return 0
