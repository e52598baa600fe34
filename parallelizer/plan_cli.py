"""``parallelize plan`` and ``parallelize check``: the layout planner's entry points.

    parallelize plan MODEL SPEC --cluster C.yaml --global-batch B [--seq S] [--top K]
                     [-o spec.yaml] [--json] [--tokens T] [--exact] [KEY=VALUE ...]
    parallelize plan --model-shape layers=..,hidden=..,heads=..,vocab=..,seq=.. --cluster C.yaml
                     --global-batch B [--top K] [--json] [--tokens T]
    parallelize check MODEL SPEC --cluster C.yaml [--global-batch B] [--seq S] [KEY=VALUE ...]

A model file is captured once on the meta device (no weights) at micro-batch 1 x S tokens;
its per-unit FLOPs and parameters (``collect_costs``) become a ``planning.workload.Workload``
that every candidate layout reuses. The search, step time and memory are pure functions in
``planning/`` (``layout_search``, ``step_time``, ``check``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from .errors import ModelFileError, UserError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", type=Path, nargs="?", help="model.py")
    p.add_argument("spec", metavar="SPEC", type=Path, nargs="?", help="parallelization spec (YAML)")
    p.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help="spec overrides")
    p.add_argument("--cluster", metavar="C.yaml", type=Path, required=True, help="cluster file")
    p.add_argument("--nodes", type=int, metavar="N", help="use N nodes of the cluster (overrides its nodes)")
    p.add_argument("--global-batch", type=int, metavar="B", help="sequences per optimizer step")
    p.add_argument("--seq", type=int, metavar="S", help="tokens per sequence (default: the example's)")


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallelize plan", description="Choose tp, pp, dp, ZeRO stage, "
                                "microbatches and checkpointing for a model on a cluster.")
    _common(p)
    p.add_argument("--model-shape", metavar="layers=..,hidden=..", help="a GPT/Llama-style shape "
                   "instead of MODEL SPEC: layers, hidden, heads, vocab, seq[, ffn, kv_heads, glu]")
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts to print (default 5)")
    p.add_argument("-o", "--out", type=Path, metavar="spec.yaml", help="write the best layout as a spec")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--tokens", type=float, metavar="T", help="training tokens: add days to train")
    p.add_argument("--fix", metavar="tp=..,pp=..", help="keep only layouts with these values "
                   "(keys tp, pp, dp, zero, mb, m, v, ac, rep), e.g. --fix tp=1,pp=1,zero=3")
    p.add_argument("--exact", action="store_true", help="also compile the best layout on the meta "
                   "device and print the exact per-rank memory estimate beside the analytical one")
    return p


def plan_main(argv: list[str]) -> int:
    """Raises UserError (exit 2): bad arguments, cluster file, model file or spec."""
    from .planning.layout_search import parse_fix, search, why

    ns = _plan_parser().parse_intermixed_args(argv)
    cluster = _cluster(ns)
    if ns.global_batch is None or ns.global_batch < 1:
        raise UserError("parallelize plan needs --global-batch B (sequences per step, >= 1)")
    spec = None
    if ns.model_shape:
        if ns.model is not None or ns.out is not None or ns.exact:
            raise UserError("--model-shape plans without a model file: drop MODEL SPEC, -o and --exact")
        from .planning.workload import from_shape, parse_shape
        shape = parse_shape(ns.model_shape)
        if ns.seq:
            shape["seq"] = ns.seq
        workload, options = from_shape(shape), {"accumulate": True}
    else:
        spec = _load(ns)
        workload = capture_workload(ns.model, ns.seq)
        # the runtime computes in bf16/fp16 only under FSDP2 (spec: mixed_precision needs 2/3)
        options = {"zero_stages": (0, 1, 2, 3) if cluster.dtype == "fp32" else (2, 3)}
    result = search(workload, cluster, ns.global_batch, fix=parse_fix(ns.fix), **options)
    if spec is not None:
        result = _runnable(result)
    top = result.ranked[:max(1, ns.top)]
    rows = [_row(p, cluster, ns.tokens, why(p, result.ranked[i + 1] if i + 1 < len(result.ranked) else None))
            for i, p in enumerate(top)]
    exact = _exact(ns.model, spec, top[0], cluster, workload.seq) if ns.exact else None
    if ns.out is not None:
        ns.out.write_text(yaml.safe_dump(layout_spec(spec, top[0].layout, cluster), sort_keys=False))
    if ns.json:
        print(json.dumps({"model": workload.name, "cluster": cluster.model_dump(mode="json"),
                          "considered": result.considered, "fitting": result.fitting,
                          "layouts": rows, "exact_memory": exact}, indent=1))
        return 0
    n = workload.param_count
    count = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n:,.0f}"
    print(f"{workload.name}: {count} parameters, {cluster.world} x "
          f"{cluster.gpu_name} ({cluster.dtype}, efficiency {cluster.achieved_efficiency:g}), "
          f"global batch {ns.global_batch} x {workload.seq} tokens; {result.considered} layouts "
          f"considered, {result.fitting} fit {_gb(cluster.usable_memory_bytes / 1e9)} "
          f"(usable_memory {cluster.usable_memory:g})")
    for i, r in enumerate(rows):
        days = f", {r['days']:.1f} days for {ns.tokens:.3g} tokens" if ns.tokens else ""
        print(f"#{i + 1} {r['layout']}: step {r['step_s']:.3g} s, {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['tflops_per_gpu']:.3g} TFLOP/s per GPU, MFU {r['mfu']:.0%}, memory "
              f"{_gb(r['memory_gb'])}{days}\n   terms: {r['terms_text']}\n   sent per GPU: "
              f"{_volumes(r['comm_gb_per_gpu'])}\n   memory: {_volumes(r['memory_parts_gb'])}\n"
              f"   why: {r['why']}")
    if exact:
        print(f"exact estimate of #1 (compiled on the meta device): fullest rank {_gb(exact['exact_gb'])} "
              f"vs analytical {_gb(exact['analytic_gb'])} ({exact['ratio']:.2f}x)")
    if ns.out is not None:
        print(f"wrote {ns.out} (compile it: parallelize MODEL {ns.out} -o OUT)")
    return 0


def _volumes(gb: dict) -> str:
    return ", ".join(f"{k} {_gb(v)}" for k, v in gb.items() if v) or "nothing"


def _runnable(result):
    """Keep the layouts the installed torch's pipelining schedules accept (the spec's own
    check, ``pipeline_schedules.check``), so that ``-o`` always writes a spec that compiles.

    Raises:
        UserError: none of the fitting layouts is accepted."""
    import dataclasses
    from .pipeline_schedules import check
    ok = [p for p in result.ranked if check(p.layout.schedule, p.layout.pp, p.layout.virtual_stages,
                                             p.layout.microbatches if p.layout.pp > 1 else 1) is None]
    if not ok:
        lay = result.ranked[0].layout
        raise UserError(f"none of the {result.fitting} fitting layouts has a pipeline schedule the "
                        f"installed torch accepts (e.g. {lay.short()}: "
                        f"{check(lay.schedule, lay.pp, lay.virtual_stages, lay.microbatches)})")
    return dataclasses.replace(result, ranked=ok, fitting=len(ok))


def _gb(x: float) -> str:
    return f"{x:.1f} GB" if x >= 1 else f"{x * 1e3:.3g} MB"


def _row(p, cluster, tokens, why_text) -> dict:
    lay = p.layout
    row = {"layout": lay.short(), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
           "dp_replicate": lay.dp_replicate, "zero_stage": lay.zero_stage,
           "micro_batch": lay.micro_batch, "microbatches": lay.microbatches,
           "virtual_stages": lay.virtual_stages, "activation_checkpointing": lay.recompute,
           "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "tflops_per_gpu": p.tflops_per_gpu,
           "mfu": p.mfu, "memory_gb": p.memory_bytes / 1e9,
           "memory_parts_gb": {k: v / 1e9 for k, v in p.memory.items() if k != "pp_rank"},
           "terms_s": p.terms, "why": why_text,
           "comm_gb_per_gpu": {k: v / 1e9 for k, v in p.volumes.items()},
           "terms_text": ", ".join(f"{k} {v:.3g} s" for k, v in p.terms.items() if v)}
    if tokens:
        row["days"] = tokens / p.tokens_per_s / 86400
    return row


def _cluster(ns):
    from .planning.cluster import cluster_from_dict, load_cluster
    cluster = load_cluster(ns.cluster)
    if ns.nodes is not None:
        cluster = cluster_from_dict({**cluster.model_dump(), "nodes": ns.nodes}, f"{ns.cluster} --nodes")
    return cluster


def _load(ns):
    from .spec import load_spec
    if ns.model is None or ns.spec is None:
        raise UserError("give MODEL SPEC (a model.py and a spec) or --model-shape "
                        "layers=..,hidden=..,heads=..,vocab=..,seq=..")
    if not ns.model.is_file():
        raise ModelFileError(f"model file {ns.model} does not exist (or is not a file)")
    return load_spec(ns.spec, ns.overrides)


_WORKLOADS: dict = {}


def capture_workload(model_path: Path, seq: int | None):
    """:func:`_capture_workload`, once per (file, modification time, seq) in a process."""
    path = Path(model_path).resolve()
    key = (path, path.stat().st_mtime_ns, seq)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = _capture_workload(path, seq)
    return _WORKLOADS[key]


def _capture_workload(model_path: Path, seq: int | None):
    """Capture ``model_path`` on the meta device at 2 x ``seq`` tokens (default the
    example's; 2 rather than 1 so that export keeps the batch dim dynamic) and turn its
    per-unit costs, halved to one sequence, into a Workload."""
    from .frontend import build_model, capture, example_batch, load_model_file
    from .passes.cleanup import apply_cleanup
    from .analysis.graph_costs import collect_costs
    from .planning.pipeline import find_blocks
    from .planning.tensors import tied_groups
    from .planning.workload import Workload

    module = load_model_file(Path(model_path))
    model = build_model(module, on_meta=True)
    model.train()
    batch = _meta_batch(example_batch(module), seq)
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    seq = first.shape[1]
    gm = capture(model, batch, Path(model_path)).gm
    apply_cleanup(gm)
    blocks = find_blocks(model)
    canonical = {n: g[0] for g in tied_groups(model) for n in g}
    costs = collect_costs(gm, blocks, canonical)
    seen, params, tied = set(), [], 0.0
    for i, u in enumerate(costs.units):
        new = [f for f in u.params if f not in seen]
        if i == len(costs.units) - 1:
            tied = sum(costs.param_bytes[f] for f in u.params if f in seen) / 4
        seen.update(new)
        params.append(sum(costs.param_bytes[f] for f in new) / 4)   # fp32 model: 4 bytes each
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or max(1, int(costs.cut_bytes[1] // (2 * seq * 4)))
    heads = getattr(cfg, "num_attention_heads", None) or max(1, hidden // 64)
    vocab = getattr(cfg, "vocab_size", 0) or 0
    return Workload(f"{Path(model_path).parent.name}/{Path(model_path).name}", seq, hidden, heads, vocab,
                    tuple(u.fwd_flops / 2 for u in costs.units),
                    tuple(u.bwd_flops / 2 for u in costs.units), tuple(params), tied,
                    ends_tp_sharded=False, flash=True)


def _meta_batch(batch, seq):
    import torch

    def one(t):
        shape = [2] + list(t.shape[1:])
        if seq and t.dim() >= 2:
            shape[1] = seq
        return torch.zeros(shape, dtype=t.dtype, device="meta")
    return {k: one(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(one(v) for v in batch)


def layout_spec(spec, lay, cluster) -> dict:
    """The spec (a dict) that compiles ``lay``: ``spec``'s other keys unchanged."""
    out = spec.to_dict()
    out["mesh"] = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate}
    out["pipeline"] = {**out["pipeline"], "microbatches": lay.microbatches if lay.pp > 1 else 1,
                       "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                       "split_points": None, "layers_per_stage": None}
    out["zero_stage"] = lay.zero_stage
    out["activation_checkpointing"] = {**out["activation_checkpointing"],
                                       "mode": "full" if lay.recompute else "none"}
    if lay.zero_stage >= 2:
        out["mixed_precision"] = {"param_dtype": cluster.dtype, "reduce_dtype": None}
    else:
        out["mixed_precision"] = {"param_dtype": "fp32", "reduce_dtype": None}
        out["fsdp"] = {"prefetch": {"forward": None, "backward": None}, "offload": False}
    from .spec import Spec
    Spec.model_validate(out)  # what we write must load unchanged
    return out


def _exact(model_path, spec, pred, cluster, seq) -> dict:
    """Compile ``pred``'s layout on the meta device and take the exact per-rank estimate
    (``memory_model.estimate_program``) for a batch of dp x M x b sequences of ``seq``."""
    import torch
    from .compiler import compile_module
    from .frontend import build_model, example_batch, load_model_file
    from .memory_model import estimate_program
    from .runtime.loss import default_loss
    from .spec import Spec

    lay = pred.layout
    chosen = Spec.model_validate(layout_spec(spec, lay, cluster))
    module = load_model_file(Path(model_path))
    model = build_model(module, on_meta=True)
    n = lay.dp * lay.micro_batch * (lay.microbatches if lay.pp > 1 else 1)
    ex = example_batch(module)
    shape = lambda t: [n, seq] + list(t.shape[2:]) if t.dim() >= 2 else [n]
    batch = ({k: torch.zeros(shape(v), dtype=v.dtype) for k, v in ex.items()}
             if isinstance(ex, dict) else tuple(torch.zeros(shape(v), dtype=v.dtype) for v in ex))
    loss_fn = getattr(module, "loss_fn", None) or default_loss
    program = compile_module(model, batch, chosen, loss_fn, model_file=Path(model_path), reference=False)
    ranks = estimate_program(program.plan, program.sources, batch, loss_fn, chosen.optimizer.name)
    exact = max(r.total for r in ranks)
    return {"exact_gb": exact / 1e9, "analytic_gb": pred.memory_bytes / 1e9,
            "ratio": exact / pred.memory_bytes}


def _check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallelize check", description="Check a spec against a "
                                "cluster: findings with numbers and a fix; exit 1 on an error.")
    _common(p)
    p.add_argument("--micro-batch", type=int, metavar="b", help="sequences per microbatch "
                   "(default: global batch / (dp x microbatches))")
    return p


def check_main(argv: list[str]) -> int:
    """Exit 1 when a finding is an error, 0 on warnings only (UserError: exit 2)."""
    ns = _check_parser().parse_intermixed_args(argv)
    spec = _load(ns)
    findings = run_check(ns.model, spec, _cluster(ns), ns.global_batch, ns.seq, ns.micro_batch)
    for f in findings:
        print(f)
    if not findings:
        print("no findings")
    return 1 if any(f.severity == "error" for f in findings) else 0


def run_check(model_path, spec, cluster, global_batch=None, seq=None, micro_batch=None) -> list:
    """Findings of ``spec`` for ``model_path`` on ``cluster`` (a Cluster or a cluster file;
    ``planning.check``), memory by the analytical model at the spec's precision and
    micro-batch size."""
    from .planning.check import check_spec
    from .planning.cluster import load_cluster
    from .planning.step_time import Layout, predict

    if not hasattr(cluster, "world"):
        cluster = load_cluster(cluster)
    m, pipe = spec.mesh, spec.pipeline
    mbs = pipe.microbatches if m.pp > 1 else 1
    if micro_batch is None and global_batch:
        micro_batch = max(1, global_batch // (m.dp * mbs))
    workload = capture_workload(Path(model_path), seq)
    dtype = spec.mixed_precision.param_dtype if spec.zero_stage >= 2 else "fp32"
    at_precision = cluster.model_copy(update={"dtype": dtype})
    pf = spec.fsdp.prefetch
    lay = Layout(m.tp, m.pp, m.dp, micro_batch or 1, mbs, spec.zero_stage, pipe.virtual_stages,
                 spec.activation_checkpointing.mode != "none", m.dp_replicate,
                 1 if pf.forward is None else pf.forward)
    pred = predict(workload, at_precision, lay)
    detail = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in pred.memory.items() if k != "pp_rank")
    detail += f", pp rank {pred.memory['pp_rank']}, micro-batch {lay.micro_batch} x {workload.seq} tokens"
    return check_spec(spec, cluster, pred.memory_bytes, detail, global_batch, micro_batch)


def check_before_compile(model_path, spec, cluster_path, global_batch=None) -> bool:
    """``parallelize MODEL SPEC --cluster C``: print the findings; False when one is an error."""
    findings = run_check(model_path, spec, cluster_path, global_batch)
    for f in findings:
        print(f, file=sys.stderr)
    return not any(f.severity == "error" for f in findings)
