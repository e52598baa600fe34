"""``python -m benchmarks.communication --compression``: bytes of the dp gradient
collectives per method, measured (benchmarks/_compression_worker.py, c10d dispatch mode)
against the analytical figure from the model's parameter shapes (see communication.py)."""
from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from parallelizer.plan.compression import powersgd_elements, topk_count

from ._comm import wire_bytes
from ._common import bench_env, compile_program, mesh_overrides, print_table, run_worker, write_json
from ._compression_worker import METHODS

CONFIGS = {"dp2-ddp": dict(dp=2, hsdp=False), "hsdp2x2-fsdp": dict(dp=4, hsdp=True)}


def _shapes(quick: bool) -> list[tuple]:
    from .communication import _bench_model
    with torch.device("meta"):
        model = _bench_model(quick).build_model()
    return [tuple(p.shape) for p in model.parameters()]  # tied weights once


def analytic(shapes, name: str, hsdp: bool) -> dict:
    """(collective, group) -> bytes sent by all ranks together, from the shapes alone."""
    m = METHODS[name]
    half = name in ("fp16", "bf16")
    elem = 2 if half else 4

    def payload(sh, method):
        if method == "powersgd":
            return sum(powersgd_elements(s, m["rank"])[0] for s in sh) * 4
        if method == "topk":
            return sum(topk_count(math.prod(s), m["ratio"]) for s in sh) * 8
        return sum(math.prod(s) for s in sh) * elem
    if not hsdp:  # DDP over dp=2: each of 2 ranks
        n = 2
        if name == "topk":
            return {("allgather", "dp"): n * (n - 1) * payload(shapes, "topk")}
        return {("allreduce", "dp"): n * wire_bytes("allreduce_", payload(shapes, name), n)}
    shard = [(-(-s[0] // 2),) + s[1:] for s in shapes]  # FSDP2 pads dim 0 to 2 equal chunks
    padded = sum(2 * math.prod(s) for s in shard) * elem
    out = {("reduce_scatter", "dp_shard"): 4 * wire_bytes("_reduce_scatter_base_", padded, 2)}
    if name == "topk":
        out[("allgather", "dp_replicate")] = 4 * payload(shard, "topk")
    else:
        out[("allreduce", "dp_replicate")] = 4 * wire_bytes("allreduce_", payload(shard, name), 2)
    return out


def _group(ranks: list[int], hsdp: bool) -> str:
    if not hsdp or len(ranks) == 4:
        return "dp"
    return "dp_shard" if ranks[1] - ranks[0] == 1 else "dp_replicate"


def measured(per_rank: list[list[dict]], hsdp: bool) -> dict:
    """(collective, group) -> {"calls", "bytes"} of the gradient collectives (0-dim loss
    all-reduces and FSDP2's parameter all-gathers in the shard group left out)."""
    out = defaultdict(lambda: {"calls": 0, "bytes": 0.0})
    for records in per_rank:
        for r in records:
            op = "allgather" if "allgather" in r["op"] else "reduce_scatter" if "reduce_scatter" in r["op"] \
                else "allreduce" if "allreduce" in r["op"] else r["op"]
            g = _group(r["ranks"], hsdp)
            integer = r["dtype"] and ("int" in r["dtype"] or r["dtype"] == "bool")
            if r["bytes"] <= 8 or (op == "allgather" and g != "dp_replicate" and hsdp) or \
                    (integer and op == "allreduce"):  # DDP's unused-parameter bitmap
                continue
            out[(op, g)]["calls"] += 1
            out[(op, g)]["bytes"] += r["wire_bytes"]
    return dict(out)


def main(quick: bool, json_path) -> None:
    env, shapes, rows, runs = bench_env(quick), _shapes(quick), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for config, c in CONFIGS.items():
            out = compile_program(Path(tmp) / config, mesh_overrides(dp=c["dp"]), env=env)
            got = run_worker(out, c["dp"], ["--hsdp"] if c["hsdp"] else [], env=env,
                             module="benchmarks._compression_worker")
            base = sum(v["bytes"] for v in measured(got["none"], c["hsdp"]).values())
            for name in METHODS:
                meas, want = measured(got[name], c["hsdp"]), analytic(shapes, name, c["hsdp"])
                total = sum(v["bytes"] for v in meas.values())
                for key in sorted(set(meas) | set(want)):
                    mb, wb = meas.get(key, {}).get("bytes", 0.0), want.get(key, 0.0)
                    rows.append([config, name, key[0], key[1], meas.get(key, {}).get("calls", 0),
                                 f"{mb / 2**20:.4f}", f"{wb / 2**20:.4f}",
                                 f"{mb / wb:.4f}" if wb else "-"])
                rows.append([f"**{config} {name} total**", "", "", "", "", f"{total / 2**20:.4f}",
                             f"{sum(want.values()) / 2**20:.4f}", f"vs none {total / base:.3f}"])
                runs.append({"config": config, "method": name, "settings": METHODS[name],
                             "measured": {f"{k[0]}@{k[1]}": v for k, v in meas.items()},
                             "analytic": {f"{k[0]}@{k[1]}": v for k, v in want.items()},
                             "ratio_to_none": total / base})
    table = print_table("gradient compression: dp gradient collectives per training step, all ranks "
                        f"(MiB sent, ring algorithms){' (quick)' if quick else ''}",
                        ["config", "method", "op", "group", "calls", "MiB measured", "MiB analytical",
                         "measured / analytical"], rows)
    write_json("communication_compression", {"quick": quick, "runs": runs, "table": table}, json_path)
