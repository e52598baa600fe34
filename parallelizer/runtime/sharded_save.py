"""Checkpoints written by every rank, without a gather (``run.py --save``, ``--save-every``,
``pm.save_checkpoint``).

Each rank writes its own file per local pipeline stage, ``pp{s}-tp{t}-dp{d}.safetensors``:
its rows of every tensor of its (stage, tp) piece (an FSDP2 parameter's local shard, or,
for a tensor every dp rank holds whole, rows ``torch.chunk``-split over dp so the dp ranks
share the writing), plus the optimizer state of those parameters in the same rows. The
manifest lists, per (stage, tp) piece, its ``chunks`` (file, rows) (checkpoint/format.py, format 2,
``chunks`` instead of ``file``), so ``reshard``, ``export``, ``--load`` and ``--resume``
read it as any other checkpoint. Nothing is pickled: tensors go to safetensors, the
per-rank file lists (names, sha256, row ranges) travel to rank 0 as JSON bytes in a tensor.

Publishing is atomic (the checkpoint exists once complete): every rank writes into the
hidden folder ``.<name>.partial`` beside the destination and fsyncs its files; rank 0
collects the file lists, writes ``manifest.json`` last, fsyncs and renames the folder onto
the destination. A job killed meanwhile leaves only ``.<name>.partial``, which
``--resume auto`` ignores and names.

Memory per rank: its own shards (already held) plus one tensor in transit (a contiguous
CPU copy of one shard while it is streamed to disk, :func:`write_streamed`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.manifest_schema import validate_manifest
from ..checkpoint.stream import write_streamed
from ..checkpoint.format import MANIFEST, OPTIM_STATES, dtype_name, optim_name
from ..checkpoint.publish import fsync_dir, publish, write_synced
from ..checkpoint.writer import FileLayout, build_manifest
from ..plan.parallel_plan import ParallelPlan
from .periodic import fault_after_rank_files, fault_disk_full, rng_state
from .setup import RankContext
from .stops import SaveFailed

PARTIAL = ".partial"


def partial_dir(out: Path) -> Path:
    """The hidden folder a save into ``out`` writes before it is complete."""
    return out.parent / f".{out.name}{PARTIAL}"


def rank_file_name(stage: int, tp_rank: int, dp_rank: int) -> str:
    return f"pp{stage}-tp{tp_rank}-dp{dp_rank}.safetensors"


def save_sharded(stages, plan: ParallelPlan, ctx: RankContext, out: Path, opt=None,
                 train: dict | None = None, extra=None) -> int:
    """Write this rank's shards of ``stages`` (:class:`LocalStages`; with ``opt``, their
    AdamW state) into ``out`` and publish it atomically (module docstring). Collective
    over all ranks. ``train``: ``{"step", "optimizer", ...}`` recorded in the manifest.
    ``extra(folder) -> (name, {"sha256", "bytes"})``: writes one more file of this rank
    (compression state) into the unpublished folder; it is listed in the manifest's
    ``files`` (sha256-checked on read) and published with the rest.
    Returns the bytes this rank wrote."""
    out = Path(out)
    tmp = partial_dir(out)
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
        tmp.mkdir(parents=True)
    dist.barrier()
    mine, extras, error = {}, {}, None
    step = train.get("step") if train is not None else None
    try:  # a write error (disk full) must reach every rank, not hang them in the gather
        for s, module in stages:
            items = _items(module, plan, opt)
            entry = _write_rank_file(tmp, s, ctx, plan, items, step) if items else None
            if entry is not None:
                mine[entry[0]] = entry[1]
        extras = dict([extra(tmp)]) if extra is not None else {}
    except OSError as e:
        error = f"rank {ctx.rank} could not write {e.filename or tmp}: {e.strerror or e}"
    if train is not None:
        fault_after_rank_files(step, ctx.rank)
    rng = rng_state(ctx.device, plan.mesh) if train is not None else None
    reports = _gather_json({"files": mine, "extra": extras, "rng": rng, "error": error}, ctx)
    errors = None
    if ctx.rank == 0:
        errors = [r["error"] for r in reports if r["error"]] or _publish_manifest(
            tmp, out, plan, reports, train)
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
    errors = _broadcast_json(errors, ctx)
    if errors:
        intact = f"; {out} is unchanged" if out.exists() else ""
        raise SaveFailed(f"the save to {out} failed and nothing was published: "
                         f"{'; '.join(errors)}{intact}; free space or save elsewhere", rank=0)
    return sum(f["bytes"] for f in mine.values()) + sum(f["bytes"] for f in extras.values())


def _publish_manifest(tmp: Path, out: Path, plan: ParallelPlan, reports: list, train) -> list:
    """Rank 0: write the manifest last and publish ``tmp`` as ``out``; the errors (empty
    when it worked)."""
    files = {k: v for r in reports for k, v in r["files"].items()}
    if train is not None:  # one RNG state per global rank, restored on the same world
        train = {**train, "world_size": len(reports), "rng": [r["rng"] for r in reports]}
    manifest = _manifest(plan, files, train)
    manifest["files"].update((k, v) for r in reports for k, v in r["extra"].items())
    validate_manifest(tmp, manifest, tmp / MANIFEST)  # our own output: a bug if it fails
    try:
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        publish(tmp, out, overwrite=True)
    except OSError as e:
        return [f"rank 0 could not write {e.filename or tmp / MANIFEST}: {e.strerror or e}"]
    return []


def _items(module, plan: ParallelPlan, opt) -> dict:
    """name -> local tensor (maybe a DTensor shard) of one stage module: its parameters and
    buffers under canonical fqns, and the optimizer state of its parameters."""
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        fqn = plan.aliases.get(name, name)
        out[fqn] = t.detach()
        st = opt.state.get(t) if opt is not None and isinstance(t, torch.nn.Parameter) else None
        for key in OPTIM_STATES:  # AdamW's; what load_optimizer_state reads back
            if st and isinstance(st.get(key), torch.Tensor):
                out[optim_name(fqn, key)] = st[key].detach()
    return out


def _rows(t: torch.Tensor, ctx: RankContext, plan: ParallelPlan, fqn: str = ""):
    """``(local rows tensor, [lo, hi])`` this rank writes of ``t``, or None when another rank
    writes them (an HSDP replica, or dp rank > 0 for a 0-d tensor)."""
    if hasattr(t, "device_mesh"):  # FSDP2 shard: write it if first on every replicated dim
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        mesh, placements = t.device_mesh, t.placements
        if any(p.is_replicate() and mesh.get_local_rank(i) != 0 for i, p in enumerate(placements)):
            return None
        local = t.to_local()
        if local.dim() == 0:
            return (local, [0, 0]) if ctx.dp_rank == 0 else None
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        assert tuple(shape) == tuple(local.shape), (shape, local.shape)
        return (local, [offset[0], offset[0] + shape[0]]) if shape[0] else None
    if t.dim() == 0:
        return (t, [0, 0]) if ctx.dp_rank == 0 else None
    dp, n, base, rank = plan.mesh["dp"], t.shape[0], 0, ctx.dp_rank
    experts = plan.tensors[fqn].experts if fqn in plan.tensors else None
    if experts is not None:  # ep rank e holds experts [lo, hi): its edp replicas share them
        base = experts.rows(experts.ep * n, ctx.ep_rank)[0]
        dp, rank = ctx.ep_mesh["edp"].size(), ctx.ep_mesh.get_local_rank("edp")
    size = -(-n // dp)  # torch.chunk's rule, as FSDP2 shards
    lo, hi = min(n, rank * size), min(n, (rank + 1) * size)
    return (t[lo:hi], [base + lo, base + hi]) if hi > lo else None


def _param_of(name: str) -> str:
    """The parameter a saved tensor belongs to: itself, or the fqn of its optimizer state."""
    return name[len("optim."):].rsplit(".", 1)[0] if name.startswith("optim.") else name


def _write_rank_file(tmp: Path, stage: int, ctx: RankContext, plan: ParallelPlan, items: dict,
                     step: int | None = None):
    """Write this rank's rows of ``items`` to its file; ``(name, {"sha256", "bytes",
    "tensors": {name: {"rows", "dtype"}}})`` or None when it holds nothing to write."""
    rows = {k: r for k, r in ((k, _rows(t, ctx, plan, _param_of(k))) for k, t in sorted(items.items())) if r}
    if not rows:
        return None
    name = rank_file_name(stage, ctx.tp_rank, ctx.dp_rank)
    specs = [(k, tuple(t.shape), t.dtype) for k, (t, _) in rows.items()]

    def produce(k):  # one tensor in transit: a CPU copy only when it lives on a GPU
        return rows[k][0].detach().cpu()

    meta = {"format": "pt", "stage": str(stage), "tp_rank": str(ctx.tp_rank),
            "dp_rank": str(ctx.dp_rank)}
    fault_disk_full(step, ctx.rank, tmp / name)
    try:
        digest, size = write_streamed(tmp / name, specs, produce, meta, fsync=True)
    except OSError as e:  # os.write's errors name no file: name it
        raise OSError(e.errno, e.strerror, str(tmp / name)) from e
    tensors = {k: {"rows": r, "dtype": dtype_name(t.dtype)} for k, (t, r) in rows.items()}
    return name, {"sha256": digest, "bytes": size, "stage": stage, "tp_rank": ctx.tp_rank,
                  "tensors": tensors}


def _manifest(plan: ParallelPlan, files: dict, train: dict | None) -> dict:
    """The format-2 manifest of the plan's layout whose pieces are the chunks in ``files``."""
    chunks: dict = {}  # (name, stage, tp) -> [{"file", "rows"}]
    dtypes: dict = {}
    for fname, f in sorted(files.items()):
        for k, t in f["tensors"].items():
            chunks.setdefault((k, f["stage"], f["tp_rank"]), []).append({"file": fname, "rows": t["rows"]})
            dtypes[k] = t["dtype"]
    params = {k: k[len("optim."):].rsplit(".", 1)[0] for k in dtypes if k.startswith("optim.")}
    layout = FileLayout.from_plan(plan, params, train, {k: dtypes[k] for k in params})
    manifest = build_manifest(layout, {n: {"sha256": f["sha256"], "bytes": f["bytes"]}
                                       for n, f in files.items()})
    for name, entry in manifest["tensors"].items():
        for pc in entry["pieces"]:
            found = chunks.get((name, pc["stage"], pc["tp_rank"]))
            assert found, f"no rank wrote {name} of stage {pc['stage']}, tp {pc['tp_rank']}"
            del pc["file"]
            pc["chunks"] = sorted(found, key=lambda c: c["rows"][0])
    return manifest


def _gather_json(obj, ctx: RankContext) -> list | None:
    """Every rank's JSON-serialisable ``obj`` on global rank 0 (None elsewhere), as UTF-8
    bytes in tensors (no pickle). Collective."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(ctx.device)
    n = torch.tensor([data.numel()], device=ctx.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    top = max(int(s) for s in sizes)
    padded = torch.zeros(top, dtype=torch.uint8, device=ctx.device)
    padded[:data.numel()] = data
    parts = [torch.empty_like(padded) for _ in sizes] if ctx.rank == 0 else None
    dist.gather(padded, parts, dst=0)
    if ctx.rank != 0:
        return None
    return [json.loads(bytes(p[:int(s)].cpu().tolist())) for p, s in zip(parts, sizes)]


def _broadcast_json(obj, ctx: RankContext):
    """Rank 0's JSON-serialisable ``obj`` on every rank (UTF-8 bytes in tensors). Collective."""
    data = json.dumps(obj).encode() if ctx.rank == 0 else b""
    n = torch.tensor([len(data)], device=ctx.device)
    dist.broadcast(n, 0)
    buf = torch.zeros(int(n), dtype=torch.uint8, device=ctx.device)
    if ctx.rank == 0 and len(data):
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()))
