"""``parallelize calibrate``: measure the cluster's compute and collectives and write them into
its cluster file's ``measured:`` section (``parallelizer/advisor/measured.py``), which
``parallelize plan`` / ``check`` then use instead of the datasheet.

    torchrun --nproc-per-node G [--nnodes N ...] -m parallelizer calibrate --cluster C.yaml
             [--thorough] [--device cpu|cuda] [-o OUT.yaml]

Run it on the cluster's own nodes, with one process per GPU (``G`` = the file's
``gpus_per_node``); on several nodes it measures the network too. Without torchrun it
measures one process's compute only. ``--thorough`` measures denser grids, more sizes and
more dtypes (minutes instead of about one).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import yaml

from ..errors import ClusterError, UserError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallelize calibrate", description="Measure matmul, attention, "
                                "elementwise and optimizer throughput and the α/β of every collective "
                                "on this cluster, and write them into the cluster file.")
    p.add_argument("--cluster", type=Path, required=True, metavar="C.yaml", help="cluster file to update")
    p.add_argument("-o", "--out", type=Path, metavar="OUT.yaml", help="write the calibrated cluster "
                   "file here instead of updating --cluster")
    p.add_argument("--thorough", action="store_true", help="denser grids and more sizes (minutes)")
    p.add_argument("--mode", choices=("quick", "thorough", "test"), help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    return p


def main(argv: list[str]) -> int:
    """Raises ClusterError / UserError (exit 2): a bad cluster file or launch."""
    ns = _parser().parse_args(argv)
    from ..advisor.cluster import load_cluster
    cluster = load_cluster(ns.cluster, calibrating=True)
    mode = ns.mode or ("thorough" if ns.thorough else "quick")
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _check_launch(cluster, ns.cluster, world, local)
    import torch
    device_type = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but CUDA is not available here; use --device cpu")
    from ..advisor.calibrate import MODES
    if (mode, device_type) not in MODES:
        raise UserError(f"--mode {mode} is for CPU tests only; use quick or --thorough on {device_type}")
    t0 = time.perf_counter()
    device, started = _init(device_type, world)
    try:
        measured = _measure(cluster, mode, device, world, local)
    finally:
        if started:
            import torch.distributed as dist
            dist.barrier()
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        measured.update(date=datetime.datetime.now().isoformat(timespec="seconds"),
                        device=_describe(device, world, local), mode=mode)
        out = ns.out or ns.cluster
        write_measured(ns.cluster, out, measured)
        print(summary(measured, time.perf_counter() - t0, out))
    return 0


def _check_launch(cluster, path: Path, world: int, local: int) -> None:
    if world > cluster.world:
        raise ClusterError(f"calibrate runs {world} processes but {path} describes {cluster.nodes} x "
                           f"{cluster.gpus_per_node} = {cluster.world} GPUs; launch at most that many "
                           f"(torchrun --nproc-per-node {cluster.gpus_per_node})")
    if world > 1 and local != cluster.gpus_per_node:
        raise ClusterError(f"calibrate runs {local} processes per node but {path} has gpus_per_node: "
                           f"{cluster.gpus_per_node}; launch torchrun --nproc-per-node "
                           f"{cluster.gpus_per_node} so that a node's ranks are its GPUs")


def _init(device_type: str, world: int):
    import torch
    import torch.distributed as dist
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world == 1:
        return device, False
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            device_id=device if device_type == "cuda" else None)
    return device, True


def _measure(cluster, mode: str, device, world: int, local: int) -> dict:
    from ..advisor import calibrate as cal
    sizes = cal.MODES[(mode, device.type)]
    timer = cal.Timer(device, sizes, world)
    dtypes = list(dict.fromkeys([cluster.dtype, *sizes.dtypes]))
    out = {"backend": "nccl" if device.type == "cuda" else ("gloo" if world > 1 else "none"),
           "device_type": device.type, "ranks": world, "nodes": max(1, world // max(local, 1)),
           "matmul": {d: cal.matmul_grid(timer, d) for d in dict.fromkeys(["fp32", *dtypes])},
           "attention": {d: cal.attention_grid(timer, d) for d in dict.fromkeys(["fp32", dtypes[0]])}}
    out["elementwise"] = cal.elementwise(timer, out["matmul"]["fp32"], out["attention"]["fp32"])
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    out["optimizer"] = cal.optimizer(timer, mesh)
    if world > 1:
        from ..advisor.calibrate_comm import measure_collectives
        out["collectives"] = measure_collectives(sizes.comm, device, world, local, sizes.reps)
        from ..advisor.calibrate_pipe import measure_pipeline
        from ..advisor.measured import Fit
        fits = out["collectives"].get("intra_node" if local > 1 else "inter_node", {}).get("send_recv", {})
        send_s = Fit(**fits[2]).seconds(4.0 * 16) if 2 in fits else 0.0   # one 16-float activation
        out["pipeline"] = measure_pipeline(device, sizes.reps, send_s)
    return out


def _describe(device, world: int, local: int) -> str:
    import torch
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        name += f" ({os.cpu_count()} cores, {torch.get_num_threads()} thread(s) per rank)"
    nodes = max(1, world // max(local, 1))
    return f"{name}, {world} rank(s) on {nodes} node(s), torch {torch.__version__}"


def write_measured(src: Path, dst: Path, measured: dict) -> None:
    """``src`` with its ``measured:`` section replaced by ``measured`` (the rest of the file,
    comments included, kept), validated, written to ``dst`` atomically.

    Raises:
        ClusterError: the result does not validate (a bug in the calibration, named)."""
    from ..advisor.cluster import cluster_from_dict
    lines = src.read_text().splitlines()
    kept, skipping = [], False
    for line in lines:
        if line.startswith("measured:"):
            skipping = True
            continue
        if skipping and line and not line[0].isspace() and not line.startswith("#"):
            skipping = False
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    body = yaml.safe_dump({"measured": measured}, default_flow_style=None, sort_keys=False, width=100)
    text = "\n".join(kept) + "\n# measured by `parallelize calibrate` (advisor/measured.py)\n" + body
    cluster_from_dict(yaml.safe_load(text), str(dst))
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, dst)


def summary(m: dict, seconds: float, out: Path) -> str:
    lines = [f"calibrated {m['device']} in {seconds:.0f} s ({m['mode']}); wrote measured: into {out}"]
    for dtype, pts in m["matmul"].items():
        best = max(pts, key=lambda p: p[3])
        lines.append(f"  matmul {dtype}: {min(p[3] for p in pts):.3g} - {best[3]:.3g} TFLOP/s "
                     f"(best at m,n,k = {best[0]},{best[1]},{best[2]})")
    e = m["elementwise"]
    lines.append(f"  elementwise: {e['latency_us']:.3g} us per op forward, {e['backward_latency_us']:.3g} "
                 f"backward, {e['bandwidth_gb_s']:.3g} GB/s")
    for scope, ops in m.get("collectives", {}).items():
        for op, fits in ops.items():
            text = ", ".join(f"g={g}: {f['latency_us']:.3g} us + {f['bandwidth_gb_s']:.3g} GB/s"
                             for g, f in sorted(fits.items()))
            lines.append(f"  {scope} {op}: {text}")
    if m.get("pipeline"):
        lines.append(f"  pipeline: {m['pipeline']['action_us']:.3g} us per compute action (torch.distributed.pipelining)")
    if not m.get("collectives"):
        lines.append("  collectives: not measured (one process; launch with torchrun --nproc-per-node G)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
