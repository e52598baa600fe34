"""Every collective of one training step (op, process group, bytes), counted by torch's own
``CommDebugMode`` (benchmarks/_comm.py) on every rank: the emitted program beside the
torch-native baseline (benchmarks/native_llama.py) and beside the analytical minimum, at
tp=2 x dp=2 (FSDP2, ZeRO-3) and tp=2 x pp=2 (1F1B), world 4, after warm-up steps with
equal losses asserted.

Analytical minimum per step (fp32; the ``-sp`` config with sequence parallelism, the others
with ``tensor_parallel.sequence_parallel=false``, as the native baseline):

- tensor parallelism, Megatron-LM (Shoeybi et al. 2019) §3: per transformer layer and
  microbatch, two all-reduces of b*s*h elements in forward (g after attention and after
  the MLP) and two in backward (f before q/k/v and before gate/up); ``b`` the microbatch.
  The vocabulary sharded over tp (vocab_parallel, §3 "input embedding"): per microbatch one
  all-reduce of b*s*h after the embedding lookup, one of b*s*h in backward (f before the LM
  head), and the cross-entropy's three all-reduces of one fp32 per loss position
  (b*(s-1) for next-token loss: the row max, the sum of exponentials, the target logit;
  torch's loss_parallel and ours alike);
- sequence parallelism (Korthikanti et al. 2022, §4.2.2): each of those all-reduces is a
  reduce-scatter plus an all-gather of the same buffer (same bytes); the inputs of the
  column_parallel linears all-gathered again in backward (2 per layer: only the shard is
  kept); the vocab_parallel embedding's all-reduce becomes a reduce-scatter (all-gather in
  backward) and the LM head's f an all-gather fused with it (gathered again in backward,
  reduce-scatter of its input gradient), and one all-reduce over tp of the norm weights'
  gradients (each rank saw its sequence shard);
- data parallelism, ZeRO-3 / FSDP (Rajbhandari et al. 2020, §7): all-gather of the
  parameters in forward, again in backward, reduce-scatter of the gradients: 1.5x DDP's
  all-reduce. FSDP2 keeps the root module (embedding, final norm, LM head) gathered from
  forward to backward (its default, and torchtitan's), so the backward all-gather covers the
  decoder layers only;
- pipeline parallelism: one activation (b*s*h) sent forward and one gradient sent back per
  microbatch and stage boundary;
- bytes a rank sends with ring algorithms (Patarasuk & Yuan 2009): all-reduce 2(N-1)/N of
  the buffer, all-gather / reduce-scatter (N-1)/N, a send its buffer.

The figure is the sum over all ranks. Target: ours equals the minimum; differences are
listed by op and mesh dim. 0-dim all-reduces (the emitted step puts the global loss on
every rank) are listed and left out of the totals.

Gradient compression rows (``--compression``, spec ``data_parallel.compression``): the
gradient collectives over dp of one step per method, at dp=2 (DDP, zero_stage 0) and HSDP
dp_replicate 2 x dp_shard 2 (zero_stage 3), counted by the same dispatch mode, beside the
analytical figure from the model's parameter shapes (not our plan): fp16/bf16 half the
buffer; PowerSGD rank r (Vogels et al. 2019) r (n + m) per n x m matrix that torch's hook
compresses (r (n + m) * 2 < n m), other tensors whole; Top-K ceil(ratio n) values + int32
indices per tensor, all-gathered (each rank sends (N-1) x its payload). Under HSDP the
reduce-scatter inside the shard group is untouched by PowerSGD/Top-K, and FSDP2's parameter
all-gathers are not gradient collectives (left out).

Expert parallelism rows (``--moe``, benchmarks/_moe_comm.py): a Mixtral at dp2 x ep2 (the
init's routing and a skewed one) and dp4 x ep2; the all-to-alls of dispatch, combine, their
backward and ``ep_route``'s counts, beside the figure computed from the unmodified model's
own routers on the same batch: per rank 2 (rows sent off-rank + rows received) x hidden x
4 bytes per layer (rows a rank routes to its own experts are not sent).

    python -m benchmarks.communication [--quick] [--compression] [--moe]
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from ._comm import wire_bytes
from ._common import (BENCH_MODEL, bench_env, base_parser, compile_program, main_guard, mesh_overrides,
                      print_table, run_worker, write_json)
from .native_llama import LAYER_TP_PLAN

CONFIGS = {"tp2-dp2-fsdp": dict(tp=2, dp=2, pp=1), "tp2-pp2": dict(tp=2, dp=1, pp=2),
           "tp2-sp-dp2-fsdp": dict(tp=2, dp=2, pp=1)}
SEQUENCE_PARALLEL = {"tp2-sp-dp2-fsdp"}  # the others: tensor_parallel.sequence_parallel=false
MICROBATCHES = 4  # benchmarks/models/spec.yaml


def _bench_model(quick: bool):
    os.environ["PZ_BENCH_SIZE"] = "quick" if quick else "full"
    spec = importlib.util.spec_from_file_location("pz_bench_model", BENCH_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dim_of(ranks: list[int], mesh: dict) -> str:
    """The mesh dim (pp, dp, tp; ranks laid out (pp, dp, tp), tp innermost) a group spans."""
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    coords = [((r // (dp * tp)), (r // tp) % dp, r % tp) for r in sorted(ranks)]
    varying = [name for i, name in enumerate(("pp", "dp", "tp")) if len({c[i] for c in coords}) > 1]
    if len(ranks) == pp * dp * tp and len(varying) > 1:
        return "world"
    return "+".join(varying) or "self"


def minimum(module, mesh: dict, micro: int, sequence_parallel: bool = False) -> dict:
    """(op, dim) -> {"calls", "wire_bytes"} summed over all ranks, from the model's config
    alone (not from our plan)."""
    cfg = module.make_config()
    b, s, h = module.SIZE["batch"], module.SIZE["seq"], cfg.hidden_size
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    m = micro if pp > 1 else 1
    act = (b // dp // m) * s * h * 4  # one microbatch's activation, bytes
    out = {}
    if tp > 1:
        loss = 3 * m * dp * tp  # vocab_parallel cross-entropy: max, sum-exp, target logit
        loss_bytes = loss * wire_bytes("allreduce_", (b // dp // m) * (s - 1) * 4, tp)
        if sequence_parallel:
            out.update(_sequence_parallel_minimum(cfg, act, m, dp, tp))
            norms = out[("allreduce_", "tp")]["wire_bytes"]
            out[("allreduce_", "tp")] = {"calls": None, "wire_bytes": norms + loss_bytes}
        else:
            calls = (4 * cfg.num_hidden_layers + 2) * m * dp * tp  # + embedding's g, head's f
            out[("allreduce_", "tp")] = {"calls": calls + loss,
                                         "wire_bytes": calls * wire_bytes("allreduce_", act, tp) + loss_bytes}
    if pp > 1:
        calls = 2 * m * (pp - 1) * dp * tp
        out[("send", "pp")] = {"calls": calls, "wire_bytes": calls * act}
    if dp > 1:
        if pp > 1:
            raise NotImplementedError("FSDP under pipelining: not a configuration of this benchmark")
        with torch.device("meta"):
            model = module.build_model()
        sharded = tuple(f"{k}.weight" for k in LAYER_TP_PLAN) + ("embed_tokens.weight",
                                                                   "lm_head.weight")
        total = layers = 0
        for name, p in model.named_parameters():
            n = p.numel() * 4 // (tp if name.endswith(sharded) else 1)
            total += n
            layers += n if ".layers." in name else 0
        ag = (total + layers) * tp  # every tp rank's shard, over the tp coordinates
        out[("_allgather_base_", "dp")] = {"calls": None, "wire_bytes": dp * wire_bytes("_allgather_base_", ag, dp)}
        out[("_reduce_scatter_base_", "dp")] = {"calls": None,
                                                "wire_bytes": dp * wire_bytes("_reduce_scatter_base_", total * tp, dp)}
        out["ddp_allreduce_wire_bytes"] = dp * wire_bytes("allreduce_", total * tp, dp)
    return out


def _sequence_parallel_minimum(cfg, act: int, m: int, dp: int, tp: int) -> dict:
    """Korthikanti et al. 2022, §4.2.2: each of TP's all-reduces becomes a reduce-scatter and
    an all-gather of the same buffer (g: reduce-scatter forward, all-gather backward; f the
    reverse), so the same bytes; plus, per layer, the all-gather again in backward of the
    inputs of q|k|v and gate|up (only their sequence shards are kept, as Megatron-LM does, for
    the sbh/t activations of Table 2); the vocab_parallel embedding's g is a reduce-scatter
    (all-gather in backward), the LM head's f an all-gather fused with it (gathered again
    in backward, input gradient reduce-scattered); and one all-reduce
    over tp of the gradients of the parameters the sequence shards read (Llama: the 2
    RMSNorm weights per layer and the final one)."""
    layers = cfg.num_hidden_layers
    rs = (4 * layers + 2) * m * dp * tp
    ag = (6 * layers + 3) * m * dp * tp
    norms = (2 * layers + 1) * cfg.hidden_size * 4
    return {("_reduce_scatter_base_", "tp"): {"calls": rs, "wire_bytes": rs * wire_bytes("_reduce_scatter_base_", act, tp)},
            ("_allgather_base_", "tp"): {"calls": ag, "wire_bytes": ag * wire_bytes("_allgather_base_", act, tp)},
            ("allreduce_", "tp"): {"calls": None,
                                   "wire_bytes": m * dp * tp * wire_bytes("allreduce_", norms, tp)}}


def tally(per_rank: list[list[dict]], mesh: dict) -> dict:
    """(op, dim) -> {"calls", "wire_bytes"} summed over ranks."""
    out = defaultdict(lambda: {"calls": 0, "wire_bytes": 0.0})
    for records in per_rank:
        for r in records:
            key = (r["op"], dim_of(r["ranks"], mesh))
            out[key]["calls"] += 1
            out[key]["wire_bytes"] += r["wire_bytes"]
    return dict(out)


def measure(name: str, quick: bool) -> dict:
    mesh = CONFIGS[name]
    env = bench_env(quick)
    with tempfile.TemporaryDirectory() as tmp:
        sp = "true" if name in SEQUENCE_PARALLEL else "false"
        out = compile_program(Path(tmp) / "out", mesh_overrides(**mesh) +
                              [f"tensor_parallel.sequence_parallel={sp}"], env=env)
        r = run_worker(out, mesh["tp"] * mesh["dp"] * mesh["pp"],
                       ["--steps", "1", "--warmup", "1", "--comm"], env=env)
    full = {**mesh, "pp": mesh["pp"]}
    ours, native = tally(r["collectives"]["ours"], full), tally(r["collectives"]["native"], full)
    low = minimum(_bench_model(quick), full, r["microbatches"], name in SEQUENCE_PARALLEL)
    ddp = low.pop("ddp_allreduce_wire_bytes", None)
    rows = []
    for key in sorted(set(ours) | set(native) | set(low)):
        o, n, mn = ours.get(key), native.get(key), low.get(key)
        ob, nb = (o or {}).get("wire_bytes", 0.0), (n or {}).get("wire_bytes", 0.0)
        mb = (mn or {}).get("wire_bytes", 0.0)
        rows.append({"op": key[0], "dim": key[1], "calls": {"ours": (o or {}).get("calls", 0),
                     "native": (n or {}).get("calls", 0), "minimum": (mn or {}).get("calls")},
                     "wire_bytes": {"ours": ob, "native": nb, "minimum": mb},
                     "ours_minus_minimum": ob - mb, "scalar": _scalar(o) and _scalar(n)})
    # 0-dim all-reduces (ours puts the global loss on every rank) are listed, not compared
    tot = {k: sum(row["wire_bytes"][k] for row in rows if not row["scalar"]) for k in ("ours", "native", "minimum")}
    return {"config": name, "mesh": mesh, "microbatches": r["microbatches"], "rows": rows, "total": tot,
            "ratio_to_minimum": tot["ours"] / tot["minimum"], "met": abs(tot["ours"] - tot["minimum"]) < 1,
            "ddp_allreduce_wire_bytes": ddp, "max_loss_diff": r["max_loss_diff"],
            "losses": r["losses"], "collectives": r["collectives"]}


def _scalar(t: dict | None) -> bool:
    """Every call of this (op, dim) moved at most one fp64 scalar per rank (loss reporting)."""
    return t is None or t["wire_bytes"] <= 8 * t["calls"]


def _mb(x) -> str:
    return f"{x / 2**20:.3f}"


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "communication")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--compression", action="store_true", help="only the gradient-compression rows")
    p.add_argument("--moe", action="store_true", help="only the expert-parallel (all-to-all) rows")
    p.add_argument("--moe-configs", nargs="+", choices=("dp2-ep2", "dp2-ep2-skewed", "dp4-ep2"),
                   default=None, help="with --moe (default: all; --quick: the dp2 x ep2 ones)")
    a = p.parse_args()
    if a.moe:
        from ._moe_comm import main as moe_main
        return moe_main(a.quick, a.json, a.moe_configs)
    if a.compression:
        from ._compression_bench import main as compression_main
        return compression_main(a.quick, a.json)
    runs = [measure(n, a.quick) for n in a.configs]
    rows = []
    for r in runs:
        for row in r["rows"]:
            c, w = row["calls"], row["wire_bytes"]
            rows.append([r["config"], row["op"] + (" (0-dim loss)" if row["scalar"] else ""), row["dim"],
                         c["ours"], c["native"],
                         "-" if c["minimum"] is None else c["minimum"], _mb(w["ours"]), _mb(w["native"]),
                         _mb(w["minimum"]), f"{row['ours_minus_minimum'] / 2**20:+.3f}"])
        t = r["total"]
        rows.append([f"**{r['config']} total**", "", "", "", "", "", _mb(t["ours"]), _mb(t["native"]),
                     _mb(t["minimum"]), f"ours/min {r['ratio_to_minimum']:.3f} (target 1.0, "
                     f"{'met' if r['met'] else 'NOT met'})"])
    table = print_table(f"communication per training step, all ranks (MiB sent, ring algorithms)"
                        f"{' (quick)' if a.quick else ''}",
                        ["config", "op", "mesh dim", "calls ours", "calls native", "calls min",
                         "MiB ours", "MiB native", "MiB min", "ours - min (MiB)"], rows)
    write_json("communication", {"quick": a.quick, "runs": runs, "table": table}, a.json)


if __name__ == "__main__":
    main_guard(main)
