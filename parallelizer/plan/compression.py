"""Gradient compression of the data-parallel reduction (spec ``data_parallel.*``): which
combinations the installed torch can run, the plan's settings, and the bytes each dp
collective moves with and without compression. Pure functions; the hooks that compress
live in ``runtime/compression.py``.

Methods and their sources:

- ``fp16`` / ``bf16``: gradients reduced in half precision (torch's DDP
  ``fp16_compress_hook`` / ``bf16_compress_hook``; FSDP2's ``MixedPrecisionPolicy.reduce_dtype``).
- ``powersgd``: rank-r approximation ``P Q^T`` of each gradient matrix by one step of power
  iteration, with error feedback and warm start (Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", Algorithm 1); torch's
  ``powerSGD_hook``. An n x m matrix sends r (n + m) elements instead of n m; tensors where
  that does not halve the size (biases, norms) go uncompressed, as torch decides
  (``min_compression_rate`` 2).
- ``topk``: each rank sends the ``ratio`` largest-magnitude entries of each gradient
  tensor (values and int32 indices, one all-gather), the rest kept as error feedback for
  the next step (Stich et al. 2018, "Sparsified SGD with Memory", Algorithm 1; Lin et al.
  2018, "Deep Gradient Compression", §3.1). torch has no such hook; ours is
  ``runtime/compression.py``.

Where they run: zero_stage 0/1 (DDP) as DDP communication hooks; zero_stage 2/3 (FSDP2)
fp16/bf16 as the reduce dtype of the reduce-scatter (and HSDP's all-reduce), PowerSGD and
Top-K only on HSDP's all-reduce across ``mesh.dp_replicate`` (FSDP2's ``set_all_reduce_hook``),
the reduce-scatter inside the shard group untouched.
"""
from __future__ import annotations

import math

LOSSY = ("powersgd", "topk")
DEFAULT_RANK, DEFAULT_START_ITER, DEFAULT_RATIO = 1, 10, 0.01
MIN_COMPRESSION_RATE = 2  # torch's powerSGD_hook default: compress only if r(n+m) * 2 < nm
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_compression(spec) -> str | None:
    """Why ``spec.data_parallel`` cannot run, or None. One sentence naming the keys, the
    values seen and the fix (the spec validator raises it as a SpecError)."""
    dpc, mesh, z = spec.data_parallel, spec.mesh, spec.zero_stage
    method = dpc.compression
    key = f"data_parallel.compression={method}"
    for section, fields in (("powersgd", dpc.powersgd), ("topk", dpc.topk)):
        for name, value in fields.model_dump().items():
            if value is not None and method != section:
                return (f"data_parallel.{section}.{name}={value} is set but {key}; set "
                        f"data_parallel.compression={section} or remove data_parallel.{section}.{name}.")
    if not dpc.error_feedback and method not in LOSSY:
        return (f"data_parallel.error_feedback=false applies to powersgd and topk only, but {key}; "
                f"remove data_parallel.error_feedback.")
    if method == "none":
        return None
    if mesh.dp == 1:
        return (f"{key} compresses the data-parallel gradient reduction, but mesh.dp is 1 (there "
                f"is none); set mesh.dp > 1 or data_parallel.compression=none.")
    mp = spec.mixed_precision
    if method in ("fp16", "bf16") and z >= 2 and mp.reduce_dtype not in (None, method):
        return (f"{key} is FSDP2's reduce dtype under zero_stage {z}, but "
                f"mixed_precision.reduce_dtype={mp.reduce_dtype} asks for another; remove one of them.")
    if method in LOSSY and z >= 2 and mesh.dp_replicate == 1:
        return (f"{key} under zero_stage {z}: FSDP2 reduce-scatters gradients inside the shard "
                f"group and torch has no hook to compress a reduce-scatter; {method} applies to "
                f"DDP (zero_stage 0 or 1) or to HSDP's all-reduce across replicas (set "
                f"mesh.dp_replicate > 1, a divisor of mesh.dp={mesh.dp}).")
    if method in LOSSY and (mp.param_dtype != "fp32" or mp.reduce_dtype not in (None, "fp32")):
        return (f"{key} with mixed_precision (param_dtype={mp.param_dtype}, reduce_dtype="
                f"{mp.reduce_dtype}): the HSDP hook would compress {mp.reduce_dtype or mp.param_dtype} "
                f"gradients, where PowerSGD's orthogonalisation and Top-K's error feedback lose "
                f"precision; use fp32 mixed_precision with {method}.")
    return None


def plan_settings(spec) -> dict:
    """``ParallelPlan.compression``: ``{"method"}`` plus, for powersgd, ``rank`` and
    ``start_iter``; for topk, ``ratio``; for both, ``error_feedback`` (defaults filled in)."""
    dpc = spec.data_parallel
    out = {"method": dpc.compression}
    if dpc.compression == "powersgd":
        out.update(rank=dpc.powersgd.rank or DEFAULT_RANK,
                   start_iter=dpc.powersgd.start_iter or DEFAULT_START_ITER)
    if dpc.compression == "topk":
        out.update(ratio=dpc.topk.ratio or DEFAULT_RATIO)
    if dpc.compression in LOSSY:
        out["error_feedback"] = dpc.error_feedback
    return out


def reduce_dtype(spec) -> str:
    """FSDP2's reduce dtype: fp16/bf16 compression under zero_stage 2/3 sets it; fp32 under
    zero_stage 0/1 (DDP reduces the fp32 gradients autocast leaves)."""
    mp = spec.mixed_precision
    if spec.zero_stage < 2:  # DDP all-reduces the fp32 gradients (autocast keeps them fp32)
        return "fp32"
    if spec.data_parallel.compression in ("fp16", "bf16"):
        return spec.data_parallel.compression
    return mp.reduce_dtype or mp.param_dtype


def topk_count(numel: int, ratio: float) -> int:
    """Entries Top-K keeps of a tensor of ``numel`` entries: ceil(ratio * numel), at least 1."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def powersgd_elements(shape: tuple, rank: int) -> tuple[int, bool]:
    """(elements sent for one gradient of ``shape``, compressed?) as torch's powerSGD_hook
    decides: the tensor viewed as (shape[0], rest) is sent as P (n x r) and Q (m x r) when
    r (n + m) * 2 < n m, else whole."""
    numel = math.prod(shape)
    if len(shape) == 0:
        return numel, False
    n = shape[0]
    m = numel // n if n else 0
    r = min(n, m, rank)
    if (n + m) * r * MIN_COMPRESSION_RATE < numel:
        return (n + m) * r, True
    return numel, False


def payload_bytes(shapes: list[tuple], settings: dict, dtype: str = "fp32") -> dict:
    """Bytes one rank puts into the dp gradient collectives of one step, for gradients of
    ``shapes`` (this rank's local tensors), uncompressed and compressed:
    ``{"method", "uncompressed", "compressed", "ops"}``; ``ops`` names the collectives
    (all-reduce for none/fp16/bf16/powersgd: P and Q and the uncompressed rest; an
    all-gather of values + int32 indices for topk, whose received buffer is world x this)."""
    method = settings.get("method", "none")
    full = sum(math.prod(s) for s in shapes) * DTYPE_BYTES[dtype]
    if method in ("fp16", "bf16"):
        return {"method": method, "uncompressed": full, "compressed": full // 2, "ops": "all-reduce"}
    if method == "powersgd":
        sent = sum(powersgd_elements(tuple(s), settings["rank"])[0] for s in shapes) * DTYPE_BYTES[dtype]
        return {"method": method, "uncompressed": full, "compressed": sent,
                "ops": "all-reduce (P, Q, uncompressed tensors)"}
    if method == "topk":
        k = sum(topk_count(math.prod(s), settings["ratio"]) for s in shapes)
        return {"method": method, "uncompressed": full, "compressed": k * (DTYPE_BYTES[dtype] + 4),
                "ops": "all-gather (values + int32 indices)"}
    return {"method": method, "uncompressed": full, "compressed": full, "ops": "all-reduce"}


def _local_shapes(plan, pp_rank: int, experts: bool = False) -> list[tuple]:
    """tp-local shapes of the parameters pp rank ``pp_rank`` holds (tp rank 0's): the ones dp
    reduces, or with ``experts`` the expert weights split over ep (their E/ep rows)."""
    stages, tp = set(plan.local_stages(pp_rank)), plan.mesh["tp"]
    # the tp piece arithmetic the checkpoint uses, cut to this ep rank's experts
    return [tuple(t.rank_shape(tp)) for t in plan.tensors.values()
            if not t.is_buffer and stages & set(t.stages) and (t.experts is not None) == experts]


def dp_collectives(plan) -> list[dict]:
    """Per pp rank, the gradient collectives over dp one step issues on one rank, with and
    without ``plan.compression``: ``{"pp_rank", "collective", "group", "ranks", "bytes",
    "compressed_bytes", "wire_bytes", "compressed_wire_bytes", "ops"}``. ``bytes``: the
    buffer handed to the collective; ``wire_bytes``: what the rank sends with ring
    algorithms (all-reduce 2(N-1)/N of the buffer, reduce-scatter (N-1)/N, all-gather of a
    payload p (N-1) p; Patarasuk & Yuan 2009). PowerSGD counts its compressed steps (the
    first ``start_iter`` steps are uncompressed). FSDP2's parameter all-gathers are not
    gradient collectives and are left out. Under expert parallelism the expert weights are
    in neither: their gradients are all-reduced, uncompressed, over the ``dp / ep`` ranks
    holding the same experts (group ``edp``; none when ep = dp). Empty when dp = 1."""
    dp, rep, z = plan.mesh["dp"], plan.dp_replicate, plan.zero_stage
    if dp == 1:
        return []
    settings, rows = plan.compression, []
    rdt = plan.reduce_dtype if z >= 2 else "fp32"
    for pp_rank in range(plan.mesh["pp"]):
        shapes = _local_shapes(plan, pp_rank)
        experts = _local_shapes(plan, pp_rank, experts=True)
        if experts and dp // plan.ep > 1:
            rows.append(_row(pp_rank, "all-reduce", "edp", dp // plan.ep,
                             payload_bytes(experts, {"method": "none"})))
        if z < 2:
            rows.append(_row(pp_rank, "all-reduce", "dp", dp, payload_bytes(shapes, settings)))
            continue
        shard = dp // rep
        full = sum(math.prod(s) for s in shapes) * DTYPE_BYTES[rdt]
        method = settings.get("method", "none")
        rs_method = method if method in ("fp16", "bf16") else "none"
        if shard > 1:
            rows.append(_row(pp_rank, "reduce-scatter", "dp_shard" if rep > 1 else "dp", shard,
                             {"uncompressed": full * 4 // DTYPE_BYTES[rdt] if rs_method != "none" else full,
                              "compressed": full, "ops": "reduce-scatter", "method": rs_method}))
        if rep > 1:  # HSDP: the shard of each gradient, all-reduced over the replicas
            shards = [(-(-s[0] // shard),) + tuple(s[1:]) if s else s for s in shapes]
            lossy = settings if method in LOSSY else {"method": "none"}
            row = payload_bytes(shards, lossy, rdt)
            if rs_method != "none":
                row = {**row, "uncompressed": row["uncompressed"] * 4 // DTYPE_BYTES[rdt], "method": rs_method}
            rows.append(_row(pp_rank, "all-reduce", "dp_replicate", rep, row))
    return rows


def _row(pp_rank: int, collective: str, group: str, n: int, b: dict) -> dict:
    def wire(nbytes: int, op: str) -> float:
        if n <= 1:
            return 0.0
        if "all-gather" in op:
            return (n - 1) * nbytes
        return (2 if collective == "all-reduce" else 1) * (n - 1) / n * nbytes
    return {"pp_rank": pp_rank, "collective": collective, "group": group, "ranks": n,
            "method": b.get("method", "none"), "bytes": b["uncompressed"], "compressed_bytes": b["compressed"],
            "wire_bytes": wire(b["uncompressed"], collective), "compressed_wire_bytes": wire(b["compressed"], b["ops"]),
            "ops": b["ops"]}


def format_dp_collectives(rows: list[dict]) -> list[str]:
    """Markdown table lines of :func:`dp_collectives` (report.md, ``parallelize estimate``)."""
    if not rows:
        return []
    out = ["| pp rank | collective | group (ranks) | method | compressed as | buffer bytes | compressed | "
           "sent (ring) | sent compressed | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["compressed_wire_bytes"] / r["wire_bytes"] if r["wire_bytes"] else 1.0
        out.append(f"| {r['pp_rank']} | {r['collective']} | {r['group']} ({r['ranks']}) | "
                   f"{r['method']} | {r['ops']} | {r['bytes']:,} | {r['compressed_bytes']:,} | {r['wire_bytes']:,.0f} | "
                   f"{r['compressed_wire_bytes']:,.0f} | {ratio:.3f} |")
    return out
