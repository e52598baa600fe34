"""``parallelize plan`` and ``parallelize check``: the layout planner's entry points.

    parallelize plan MODEL SPEC --cluster C.yaml --global-batch B [--seq S] [--top K]
                     [-o spec.yaml] [--json] [--tokens T] [--exact] [KEY=VALUE ...]
    parallelize plan --model-shape layers=..,hidden=..,heads=..,vocab=..,seq=.. --cluster C.yaml
                     --global-batch B [--top K] [--json] [--tokens T]
    parallelize check MODEL SPEC --cluster C.yaml [--global-batch B] [--seq S] [KEY=VALUE ...]

A model file is captured once on the meta device (no weights) at micro-batch 1 x S tokens;
its per-unit FLOPs and parameters (``advisor/capture.py``) become a ``Workload`` that every
candidate layout reuses. The search, step time and memory are pure functions in
``advisor/`` (``search``, ``step_time``, ``check``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from ..advisor.capture import capture_workload
from ..advisor.check import run_check
from ..advisor.explain import REP_LEGEND, explain, sources_line
from ..advisor.layout_spec import exact_memory, layout_spec
from ..errors import ModelFileError, UserError


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
                   "instead of MODEL SPEC: layers, hidden, heads, vocab, seq[, ffn, kv_heads, glu]"
                   "[, experts, topk, moe_ffn: a mixture of experts in every block]")
    p.add_argument("--attention", choices=("flash", "eager"), default=None, help="with "
                   "--model-shape: how attention runs: flash (default: a fused SDPA / FlashAttention "
                   "kernel, scores not stored) or eager (scores, softmax and dropout materialised)")
    p.add_argument("--explain", type=int, nargs="?", const=1, metavar="K", help="print the time "
                   "breakdown of layout #K (default 1): compute, each collective, bubble, exposed "
                   "communication")
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts to print (default 5)")
    p.add_argument("-o", "--out", type=Path, metavar="spec.yaml", help="write the best layout as a spec")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--tokens", type=float, metavar="T", help="training tokens: add days to train")
    p.add_argument("--fix", metavar="tp=..,pp=..", help="keep only layouts with these values "
                   "(keys tp, pp, dp, zero, mb, m, v, ac, rep, ep; rep=R: HSDP with R replica groups; "
                   "ep=E: expert parallelism, carved out of dp), "
                   "e.g. --fix tp=1,pp=1,zero=3")
    p.add_argument("--exact", action="store_true", help="also compile the best layout on the meta "
                   "device and print the exact per-rank memory estimate beside the analytical one")
    return p


def plan_main(argv: list[str]) -> int:
    """Raises UserError (exit 2): bad arguments, cluster file, model file or spec."""
    from ..advisor.search import parse_fix, search, why

    ns = _plan_parser().parse_intermixed_args(argv)
    cluster = _cluster(ns)
    if ns.global_batch is None or ns.global_batch < 1:
        raise UserError("parallelize plan needs --global-batch B (sequences per step, >= 1)")
    spec = None
    if ns.model_shape:
        if ns.model is not None or ns.out is not None or ns.exact:
            raise UserError("--model-shape plans without a model file: drop MODEL SPEC, -o and --exact")
        from ..advisor.workload import from_shape, parse_shape
        shape = parse_shape(ns.model_shape)
        if ns.seq:
            shape["seq"] = ns.seq
        workload = from_shape(shape, attention=ns.attention or "flash")
    elif ns.attention is not None:
        raise UserError(f"--attention {ns.attention} goes with --model-shape: a model file's "
                        f"attention is what its graph runs; drop --attention")
    else:
        spec = _load(ns)
        workload = capture_workload(ns.model, ns.seq)
    # what the runtime executes: bf16/fp16 only under FSDP2 (the spec's mixed_precision needs
    # ZeRO 2/3), one microbatch at pp = 1 (run.py has no gradient accumulation)
    options = {"zero_stages": (0, 1, 2, 3) if cluster.dtype == "fp32" else (2, 3), "accumulate": False}
    if spec is not None:
        options["sequence_parallel"] = spec.tensor_parallel.sequence_parallel_mode != "false"
    result = search(workload, cluster, ns.global_batch, fix=parse_fix(ns.fix), **options)
    if spec is not None:
        result = _runnable(result)
    top = result.ranked[:max(1, ns.top)]
    rows = [_row(p, cluster, ns.tokens, why(p, result.ranked[i + 1] if i + 1 < len(result.ranked) else None))
            for i, p in enumerate(top)]
    exact = exact_memory(ns.model, spec, top[0], cluster, workload.seq) if ns.exact else None
    if ns.out is not None:
        ns.out.write_text(yaml.safe_dump(layout_spec(spec, top[0].candidate, cluster), sort_keys=False))
    if ns.json:
        print(json.dumps({"model": workload.name, "cluster": cluster.model_dump(mode="json", exclude={"measured"}),
                          "calibrated": None if cluster.measured is None else
                          {"date": cluster.measured.date, "device": cluster.measured.device},
                          "figures": sources_line(cluster, workload), "attention": workload.attention,
                          "considered": result.considered, "fitting": result.fitting,
                          "layouts": rows, "exact_memory": exact}, indent=1))
        return 0
    n = workload.param_count
    count = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n:,.0f}"
    print(f"{workload.name}: {count} parameters, {cluster.world} x "
          f"{cluster.gpu_name} ({cluster.dtype}), "
          f"global batch {ns.global_batch} x {workload.seq} tokens; {result.considered} layouts "
          f"considered, {result.fitting} fit {_gb(cluster.usable_memory_bytes / 1e9)} "
          f"(usable_memory {cluster.usable_memory:g})\n{sources_line(cluster, workload)}")
    for i, r in enumerate(rows):
        days = f", {r['days']:.1f} days for {ns.tokens:.3g} tokens" if ns.tokens else ""
        print(f"#{i + 1} {r['layout']}: step {r['step_s']:.3g} s, {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['tflops_per_gpu']:.3g} TFLOP/s per GPU, MFU {r['mfu']:.0%}, memory "
              f"{_gb(r['memory_gb'])}{days}\n   terms: {r['terms_text']}\n   sent per GPU: "
              f"{_volumes(r['comm_gb_per_gpu'])}\n   memory: {_volumes(r['memory_parts_gb'])}\n"
              f"   why: {r['why']}")
    if any(p.candidate.dp_replicate > 1 for p in top):
        print(REP_LEGEND)
    if ns.explain:
        k = min(max(1, ns.explain), len(result.ranked))
        print(explain(result.ranked[k - 1], k))
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
    check, ``plan.schedules.check``), so that ``-o`` always writes a spec that compiles.

    Raises:
        UserError: none of the fitting layouts is accepted."""
    import dataclasses
    from ..plan.schedules import check
    ok = [p for p in result.ranked if check(p.candidate.schedule, p.candidate.pp, p.candidate.virtual_stages,
                                             p.candidate.microbatches if p.candidate.pp > 1 else 1) is None]
    if not ok:
        lay = result.ranked[0].candidate
        raise UserError(f"none of the {result.fitting} fitting layouts has a pipeline schedule the "
                        f"installed torch accepts (e.g. {lay.short()}: "
                        f"{check(lay.schedule, lay.pp, lay.virtual_stages, lay.microbatches)})")
    return dataclasses.replace(result, ranked=ok, fitting=len(ok))


def _gb(x: float) -> str:
    return f"{x:.1f} GB" if x >= 1 else f"{x * 1e3:.3g} MB"


def _row(p, cluster, tokens, why_text) -> dict:
    lay = p.candidate
    row = {"layout": lay.short(), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
           "dp_replicate": lay.dp_replicate, "ep": lay.ep, "zero_stage": lay.zero_stage,
           "micro_batch": lay.micro_batch, "microbatches": lay.microbatches,
           "virtual_stages": lay.virtual_stages, "activation_checkpointing": lay.recompute,
           "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "tflops_per_gpu": p.tflops_per_gpu,
           "mfu": p.mfu, "memory_gb": p.memory_bytes / 1e9,
           "memory_parts_gb": {k: v / 1e9 for k, v in p.memory.items() if k != "pp_rank"},
           "terms_s": p.terms, "why": why_text, "breakdown": p.breakdown,
           "schedule": lay.schedule if lay.pp > 1 else None,
           "sequence_parallel": lay.sequence_parallel and lay.tp > 1,
           "comm_gb_per_gpu": {k: v / 1e9 for k, v in p.volumes.items()},
           "terms_text": ", ".join(f"{k} {v:.3g} s" for k, v in p.terms.items() if abs(v) > 1e-6 * p.step_s)}
    if tokens:
        row["days"] = tokens / p.tokens_per_s / 86400
    return row


def _cluster(ns):
    from ..advisor.cluster import cluster_from_dict, load_cluster
    cluster = load_cluster(ns.cluster)
    if ns.nodes is not None:
        cluster = cluster_from_dict({**cluster.model_dump(), "nodes": ns.nodes}, f"{ns.cluster} --nodes")
    return cluster


def _load(ns):
    from ..frontend.spec import load_spec
    if ns.model is None or ns.spec is None:
        raise UserError("give MODEL SPEC (a model.py and a spec) or --model-shape "
                        "layers=..,hidden=..,heads=..,vocab=..,seq=..")
    if not ns.model.is_file():
        raise ModelFileError(f"model file {ns.model} does not exist (or is not a file)")
    return load_spec(ns.spec, ns.overrides)


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


def check_before_compile(model_path, spec, cluster_path, global_batch=None) -> bool:
    """``parallelize MODEL SPEC --cluster C``: print the findings; False when one is an error."""
    findings = run_check(model_path, spec, cluster_path, global_batch)
    for f in findings:
        print(f, file=sys.stderr)
    return not any(f.severity == "error" for f in findings)
