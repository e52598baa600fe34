"""``python -m benchmarks.communication --moe``: the all-to-alls of expert parallelism per
training step, measured (benchmarks/_moe_worker.py, _comm.py's dispatch mode on every rank)
against the analytical figure from the unmodified model's own routing.

Analytical side, independent of the program: the unmodified ``MixtralForCausalLM``
(benchmarks/models/mixtral_bench.py) is trained eagerly for the same warm-up steps on the
same global batches with the spec's optimizer, then each dp rank's rows of the recorded
batch go through it with a forward hook on every layer's router (``mlp.gate``, its top-k
expert indices). For dp rank ``d`` (ep rank ``d % ep``, replica ``d // ep``) and each layer:
``sent`` = its (token, expert) rows whose expert lives on another ep rank (expert ``e`` on
ep rank ``e // (E / ep)``), ``received`` = the rows the other ep ranks of its replica send to
its experts. Rows for its own experts never leave the rank (the ring convention of
_comm.py: bytes sent). Per layer and step the rank sends ``sent`` rows in the forward
dispatch, ``received`` in the combine, ``received`` again in the dispatch's backward (the
reverse all-to-all of the gradients) and ``sent`` in the combine's backward: 2 (sent +
received) x hidden x 4 bytes (fp32), in 4 all-to-alls; plus ``ep_route``'s exchange of the E
int64 row counts, of which E - E/ep leave the rank. Summed over ranks: 4 x the rows
dispatched off-rank. The program's own counts are never read: a wrong split, a row sent
twice or a missing backward all-to-all makes the two columns differ.

Configs: dp2 x ep2 with the init's routing, dp2 x ep2 with skewed routing (expert 0 in
nearly every token's top-2: ``PZ_BENCH_ROUTING=skewed``), and (not ``--quick``) dp4 x ep2
(two expert replicas: the expert gradients all-reduced over edp). ZeRO-3 (the bench spec):
FSDP2's all-gathers / reduce-scatters of the dense parameters are listed beside, not
compared.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from parallelizer.runtime.optim import make_optimizer

from ._common import REPO, bench_env, compile_program, print_table, run_worker, write_json

MODEL = REPO / "benchmarks" / "models" / "mixtral_bench.py"
SPEC = REPO / "benchmarks" / "models" / "spec.yaml"
CONFIGS = {"dp2-ep2": dict(dp=2, ep=2, routing="random"),
           "dp2-ep2-skewed": dict(dp=2, ep=2, routing="skewed"),
           "dp4-ep2": dict(dp=4, ep=2, routing="random")}
QUICK_CONFIGS = ("dp2-ep2", "dp2-ep2-skewed")
WARMUP = 1


def load_model(quick: bool, routing: str):
    """benchmarks/models/mixtral_bench.py at the size and routing the program was compiled
    with (its module-level SIZE reads the environment)."""
    saved = {k: os.environ.get(k) for k in ("PZ_BENCH_SIZE", "PZ_BENCH_ROUTING")}
    os.environ.update(PZ_BENCH_SIZE="quick" if quick else "full", PZ_BENCH_ROUTING=routing)
    try:
        spec = importlib.util.spec_from_file_location(f"pz_moe_bench_{routing}", MODEL)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return module


def routed_rows(module, optimizer: dict, warmup: int, recorded: int, dp: int) -> list[list[torch.Tensor]]:
    """[dp rank][layer] -> (tokens x top_k,) expert indices the unmodified model's routers
    choose for that rank's rows of batch ``recorded``, after ``warmup`` eager training steps
    on the full global batches (the program's steps, done by the original model)."""
    model = module.build_model().train()
    opt = make_optimizer(model.parameters(), optimizer["name"], optimizer["lr"],
                         optimizer.get("weight_decay", 0.0))
    batches = list(zip(range(recorded + 1), module.batches()))
    for _, batch in batches[:warmup]:
        opt.zero_grad(set_to_none=True)
        module.loss_fn(model(**batch), batch).backward()
        opt.step()
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2].flatten()))
             for layer in model.model.layers]
    ids = batches[recorded][1]["input_ids"]
    n = ids.shape[0] // dp
    out = []
    with torch.no_grad():
        for d in range(dp):
            seen.clear()
            model(input_ids=ids[d * n:(d + 1) * n])
            out.append(list(seen))
    for h in hooks:
        h.remove()
    return out


def analytical(rows: list[list[torch.Tensor]], experts: int, ep: int, hidden: int) -> list[dict]:
    """Per dp rank: off-rank rows sent / received per layer, the all-to-all calls and the
    bytes it sends (rows: 2 (sent + received) x hidden x 4; counts: (E - E/ep) x 8 per layer)."""
    local = experts // ep
    dp = len(rows)
    # to[d][layer][r]: rows of dp rank d for the experts of ep rank r
    to = [[torch.bincount(idx // local, minlength=ep).tolist() for idx in layers] for layers in rows]
    out = []
    for d in range(dp):
        me, replica = d % ep, d // ep
        peers = [p for p in range(dp) if p // ep == replica and p != d]
        sent = [sum(c for r, c in enumerate(layer) if r != me) for layer in to[d]]
        received = [sum(to[p][i][me] for p in peers) for i in range(len(to[d]))]
        layers = len(sent)
        out.append({"rank": d, "sent_rows": sent, "received_rows": received,
                    "rows": {"calls": 4 * layers, "wire_bytes": sum(2 * (s + r) * hidden * 4
                                                                   for s, r in zip(sent, received))},
                    "counts": {"calls": layers, "wire_bytes": layers * (experts - local) * 8}})
    return out


def measured(records: list[dict]) -> dict:
    """One rank's records -> {"rows": ..., "counts": ...} of its all-to-alls (float rows,
    int64 counts), and (op, group size) -> calls / bytes of the other collectives."""
    out = defaultdict(lambda: {"calls": 0, "wire_bytes": 0.0})
    for r in records:
        if r["op"] == "alltoall_base_":
            key = "counts" if "int" in r["dtype"] else "rows"
        else:
            key = (r["op"], len(r["ranks"]))
        out[key]["calls"] += 1
        out[key]["wire_bytes"] += r["wire_bytes"]
    return dict(out)


def measure(name: str, quick: bool, tmp: Path) -> dict:
    c = CONFIGS[name]
    env = {**bench_env(quick), "PZ_BENCH_ROUTING": c["routing"]}
    out = compile_program(tmp / name, [f"mesh.dp={c['dp']}", f"mesh.ep={c['ep']}",
                                       "pipeline.microbatches=1"], model=MODEL, spec=SPEC, env=env)
    r = run_worker(out, c["dp"], ["--comm", "--warmup", str(WARMUP)],
                   env=env, module="benchmarks._moe_worker")
    module = load_model(quick, c["routing"])
    cfg = module.make_config()
    spec = OmegaConf.to_container(OmegaConf.load(out / "spec.yaml"))
    routes = routed_rows(module, spec["optimizer"], WARMUP, r["recorded_batch"], c["dp"])
    want = analytical(routes, cfg.num_local_experts, c["ep"], cfg.hidden_size)
    got = [measured(recs) for recs in r["collectives"]]
    share = torch.bincount(torch.cat([x for layers in routes for x in layers]),
                           minlength=cfg.num_local_experts).float()
    return {"config": name, **c, "analytical": want,
            "measured": [{k if isinstance(k, str) else f"{k[0]}@{k[1]}": v for k, v in g.items()} for g in got],
            "expert_share": (share / share.sum()).tolist(), "losses": r["losses"],
            "met": all(g.get(k) == w[k] for g, w in zip(got, want) for k in ("rows", "counts"))}


def _mib(x) -> str:
    return f"{x / 2**20:.4f}"


def tables(runs: list[dict], quick: bool) -> str:
    rows, per_rank = [], []
    for run in runs:
        for key, what in (("rows", "rows (dispatch, combine, 2 backward)"), ("counts", "counts (ep_route)")):
            m = [g.get(key, {"calls": 0, "wire_bytes": 0}) for g in run["measured"]]
            a = [w[key] for w in run["analytical"]]
            mb, ab = sum(x["wire_bytes"] for x in m), sum(x["wire_bytes"] for x in a)
            rows.append([run["config"], run["routing"], f"all-to-all {what}", "ep",
                         sum(x["calls"] for x in m), sum(x["calls"] for x in a), _mib(mb), _mib(ab),
                         f"{mb / ab:.4f}" if ab else "-"])
        others = defaultdict(lambda: [0, 0.0])
        for g in run["measured"]:
            for k, v in g.items():
                if k not in ("rows", "counts"):
                    others[k][0] += v["calls"]
                    others[k][1] += v["wire_bytes"]
        for k, (calls, b) in sorted(others.items()):
            op, size = k.split("@")
            rows.append([run["config"], run["routing"], op + (" (0-dim loss)" if b <= 8 * calls else ""),
                         f"{size} ranks", calls, "-", _mib(b), "-", "-"])
        top = max(run["expert_share"])
        for g, w in zip(run["measured"], run["analytical"]):
            per_rank.append([run["config"], w["rank"], sum(w["sent_rows"]), sum(w["received_rows"]),
                             g.get("rows", {}).get("calls", 0), _mib(g.get("rows", {}).get("wire_bytes", 0)),
                             _mib(w["rows"]["wire_bytes"]), "yes" if g.get("rows") == w["rows"] and
                             g.get("counts") == w["counts"] else "NO", f"{top:.3f}"])
    q = " (quick)" if quick else ""
    t1 = print_table(f"expert parallelism: collectives per training step, all ranks (MiB sent; all-to-all "
                     f"rows to the rank itself not counted){q}",
                     ["config", "routing", "op", "group", "calls measured", "calls analytical",
                      "MiB measured", "MiB analytical", "measured / analytical"], rows)
    t2 = print_table(f"expert parallelism: all-to-all rows per rank (off-rank rows over all layers, from "
                     f"the unmodified model's routers){q}",
                     ["config", "dp rank", "rows sent (dispatch)", "rows received (dispatch)",
                      "row all-to-alls", "MiB measured", "MiB analytical", "equal (rows and counts)",
                      "largest expert's share of rows"], per_rank)
    return t1 + "\n" + t2  # as printed


def main(quick: bool, json_path, configs=None) -> None:
    names = configs or (QUICK_CONFIGS if quick else tuple(CONFIGS))
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(n, quick, Path(tmp)) for n in names]
    table = tables(runs, quick)
    ok = all(r["met"] for r in runs)
    print(f"measured == analytical: {'yes' if ok else 'NO'} ({len(runs)} configs)", flush=True)
    write_json("communication_moe", {"quick": quick, "runs": runs, "table": table, "met": ok}, json_path)
