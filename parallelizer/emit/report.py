"""report.md: what the compiler decided and why, for a human."""
from __future__ import annotations

import re

import torch

from ..analysis.graph_facts import module_path
from ..plan.compression import dp_collectives, format_dp_collectives
from ..plan.parallel_plan import ParallelPlan
from ..plan.size_guards import spans_text

_DP = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 per block, kept after forward",
       3: "FSDP2 per block, resharded after forward"}


def _fsdp_options(plan: ParallelPlan) -> str:
    if plan.zero_stage < 2:
        return ""
    hsdp = (f"HSDP dp_replicate={plan.dp_replicate} x dp_shard={plan.mesh['dp'] // plan.dp_replicate}, "
            if plan.dp_replicate > 1 else "")
    return (f"; {hsdp}prefetch forward {plan.prefetch_forward} / backward {plan.prefetch_backward}, "
            f"param_dtype {plan.param_dtype}, reduce_dtype {plan.reduce_dtype}"
            + (", CPU offload" if plan.offload else ""))


def render_report(plan: ParallelPlan, route: str, tp_lines, pipeline: dict, notes,
                  pp_warnings=(), attention=()) -> str:
    """report.md. ``attention``: ``(module FQN, changes)`` of the SDPA calls the
    eager_attention pass rewrote."""
    m = plan.mesh
    lines = ["# parallelizer report", "",
             f"- mesh: pp={m['pp']} x dp={m['dp']} x tp={m['tp']} = {plan.world_size} ranks "
             f"(order pp, dp, tp; tp innermost)",
             f"- capture: {route}",
             *_size_lines(plan),
             f"- schedule: {plan.schedule}, microbatches: {plan.microbatches}; "
             f"data parallel: {_DP[plan.zero_stage]} over dp (zero_stage {plan.zero_stage})"
             + _fsdp_options(plan),
             ]
    lines += attention_section(attention)
    lines += ["", "## Tensor parallel", ""]
    lines += [f"- {line}" for line in tp_lines] or ["- tp=1: nothing sharded"]
    sharded = [t for t in plan.tensors.values() if t.tp_dim is not None]
    lines += ["", "| tensor | shape | placement | role |", "|---|---|---|---|"]
    for t in sharded:
        layout = f", {t.layout.kind}" if t.layout and not _unpadded(t) else ""
        ep = f"; {t.experts.text()}" if t.experts is not None else ""  # ep x tp: both cuts
        lines.append(f"| {t.fqn} | {list(t.shape)} | Shard({t.tp_dim}){layout}{ep} | {t.role} |")
    lines += dp_section(plan)
    lines += pipeline_section(plan, pipeline, pp_warnings)
    tied = [t.fqn for t in plan.tensors.values() if len(t.stages) > 1]
    if tied:
        lines += ["", f"Tied across stages (gradients summed between them): {', '.join(tied)}"]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _size_lines(plan: ParallelPlan) -> list[str]:
    """One line per input size the model's code fixes (``plan.fixed_sizes``: run.py's
    refusal of another size points here; a 2-D input's features, fixed by its first layer,
    drew no compile warning and were named nowhere, zoo 17 Z1), per size it bounds
    (``plan.size_ranges``) and per guard that excludes sizes (``plan.size_guards``)."""
    words = {0: ("batch size per microbatch and dp rank", "--batch-size"),
             1: ("sequence length", "--seq-len")}
    out = [f"- input {name!r}: dim {d} is {size} in every step, fixed by the model's code (a "
           f"layer over that dim, a loop over it, a size written as a number); run.py refuses "
           f"another {words[d][1]}" for name, d, size in plan.fixed_sizes]
    for name, d, low, high, where in plan.size_ranges:
        what, flag = words[d]
        span = f"{low}..{high}" if high else f"at least {low}"
        out.append(f"- input {name!r}: the model's code accepts the {what} {span}"
                   f"{' (' + where + ')' if where else ''}; run.py refuses another {flag}")
    highs = {(name, d): high for name, d, _, high, _ in plan.size_ranges if high}
    for name, d, size, text, _, excluded in plan.size_guards:
        what, flag = words[d]
        top = max(4 * size, 256)
        if excluded and excluded != ((highs.get((name, d), 0) + 1, top),):  # not the range's
            out.append(f"- input {name!r}: captured under `{text}`, which the {what} "
                       f"{spans_text(excluded)} break(s) (of 2..{top}); run.py "
                       f"refuses a {flag} that breaks it")
    return out


def _unpadded(t) -> bool:
    """A vocabulary table whose padded layout adds no rows (tp divides the vocabulary): the
    report shows it as the even split it is."""
    return t.layout.kind == "padded" and t.layout.padded_size == t.shape[t.tp_dim]


def dp_section(plan: ParallelPlan) -> list[str]:
    """``## Data-parallel gradient communication``: bytes per step of each dp gradient
    collective on one rank, with and without ``data_parallel.compression``."""
    rows = dp_collectives(plan)
    if not rows:
        return []
    c = plan.compression
    detail = ", ".join(f"{k} {v}" for k, v in c.items() if k != "method")
    return ["", "## Data-parallel gradient communication", "",
            f"- compression: {c.get('method', 'none')}" + (f" ({detail})" if detail else "")
            + "; bytes per training step on one rank of each pp rank (tp rank 0), buffer and "
              "sent with ring algorithms; powersgd after its warm-up", ""] + format_dp_collectives(rows)


_SPLIT = {"balanced": "balanced by forward + backward FLOPs (contiguous min-max partition)",
          "pipeline.split_points": "fixed by pipeline.split_points",
          "pipeline.layers_per_stage": "fixed by pipeline.layers_per_stage"}


def pipeline_section(plan: ParallelPlan, pipeline: dict, pp_warnings=(), pictures=True) -> list[str]:
    """``## Pipeline stages``: per-stage cost table, imbalance, theoretical bubble, pictures;
    what a stage sends is its summary's ``sends`` (:func:`stage_sends`), else its boundary
    node names."""
    p, m, v = pipeline["pp"], pipeline["microbatches"], pipeline["virtual_stages"]
    formula = f"(P-1)/(v*M+P-1), v={v}" if v > 1 else "(P-1)/(M+P-1)"
    batch = "x".join(str(d) for d in pipeline["batch_shape"]) or "?"
    lines = ["", "## Pipeline stages", "",
             f"- split: {_SPLIT.get(pipeline['split'], pipeline['split'])}; imbalance "
             f"{pipeline['imbalance']:.3f} (max / mean stage FLOPs)",
             f"- theoretical bubble: {pipeline['bubble']:.1%} = {formula} with P={p}, M={m} "
             f"({pipeline['schedule']})",
             f"- FLOPs (all tp ranks of a stage together) and activation bytes are for one step "
             f"of the example batch ({batch}), by torch.utils.flop_counter (matmul, attention, "
             f"convolution)",
             "", "| stage | blocks | GFLOP fwd | GFLOP bwd | parameter bytes | activation bytes sent "
                 "| sends (module: shape per rank) |",
             "|---|---|---|---|---|---|---|"]
    for st, s in zip(plan.stages, pipeline["stages"]):
        blocks = _blocks_cell(st.blocks, s.get("children", {}))
        lines.append(f"| {st.index} | {blocks} | {s['fwd_flops'] / 1e9:.4g} | {s['bwd_flops'] / 1e9:.4g} "
                     f"| {s['param_bytes']:,} | {s['activation_bytes_sent']:,} "
                     f"| {'; '.join(s.get('sends') or st.outputs) or 'outputs'} |")
    lines += [f"- warning: {w}" for w in pp_warnings]
    lines += [f"- {n}" for n in pipeline["notes"]]
    if pictures:
        lines += ["", "![stage cost](pipeline_costs.png)"]
    if pictures and p > 1:
        lines += ["", "![schedule](pipeline_schedule.png)"]
    return lines


def _blocks_cell(blocks, children: dict) -> str:
    """``model.layers.0 .. model.layers.3``; a block cut across stages names the children
    held here: ``model.layers.4 (post_attention_layernorm, mlp)``."""
    if not blocks:
        return "-"

    def one(b):
        kids = children.get(b)
        return f"{b} ({', '.join(k.rsplit('.', 1)[1] for k in kids)})" if kids else b
    return " .. ".join(dict.fromkeys([one(blocks[0]), one(blocks[-1])]))


def attention_section(rewritten) -> list[str]:
    """``## Attention``: the SDPA calls put back the way eager runs them (passes/attention.py),
    one line per kind of change with the modules it was made in."""
    if not rewritten:
        return []
    groups: dict = {}
    for where, changes in rewritten:
        groups.setdefault(changes, []).append(where or "the root module")
    lines = ["", "## Attention", "",
             "- scaled_dot_product_attention as eager code calls it: a mask proven from its ops "
             "for every sequence length, kv heads repeated by expand + reshape (passes/attention.py)"]
    return lines + [f"- {', '.join(changes)}: {modules_text(mods)}" for changes, mods in groups.items()]


def modules_text(fqns: list[str]) -> str:
    """``model.layers.{0..3}.self_attn`` for the modules of a run of numbered blocks; the names
    joined otherwise."""
    keys: dict = {}
    for fqn in dict.fromkeys(fqns):
        m = re.search(r"(^|\.)(\d+)(\.|$)", fqn)
        key = (fqn[:m.start(2)], fqn[m.end(2):]) if m else (fqn, None)
        keys.setdefault(key, []).append(int(m.group(2)) if m else None)
    out = []
    for (head, tail), nums in keys.items():
        if tail is None or len(nums) == 1:
            out += [f"{head}{n}{tail}" if tail is not None else head for n in nums]
        elif sorted(nums) == list(range(min(nums), max(nums) + 1)):
            out.append(f"{head}{{{min(nums)}..{max(nums)}}}{tail}")
        else:
            out.append(f"{head}{{{','.join(map(str, nums))}}}{tail}")
    return ", ".join(out)


def stage_sends(stages, inputs, region: dict, tp: int) -> dict[int, list[str]]:
    """Stage index -> what it sends to the next stage, as ``module: (dims) dtype`` with the
    shape one rank sends: ``batch`` / ``seq`` for the dynamic dims of the model's inputs, a
    sequence shard (sequence parallelism, ``region``: node name -> (dim, flat)) as ``seq/tp``.
    The last stage sends the model's outputs (absent)."""
    names = _dim_names(inputs)
    out = {}
    for st in stages[:-1]:
        by_name = {n.name: n for n in st.graph.nodes}
        texts = [_send_text(by_name[o], names, region.get(o), tp) if o in by_name else o
                 for o in st.outputs]
        counts = {t: texts.count(t) for t in texts}  # two values of one module and shape
        out[st.index] = [t if n == 1 else f"{t} (x{n})" for t, n in counts.items()]
    return out


def _dim_names(inputs) -> dict:
    """Symbol -> "batch" / "seq" from the dynamic dims 0 and 1 of the captured inputs."""
    names = {}
    for node in inputs:
        val = node.meta.get("val")
        for d, label in ((0, "batch"), (1, "seq")):
            if isinstance(val, torch.Tensor) and val.dim() > d and isinstance(val.shape[d], torch.SymInt):
                names.setdefault(str(val.shape[d].node.expr), label)
    return names


def _send_text(node, names: dict, seq_place, tp: int) -> str:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return node.name
    dims = []
    for s in val.shape:
        text = str(s.node.expr) if isinstance(s, torch.SymInt) else str(s)
        for sym, label in sorted(names.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"\b{sym}\b", label, text)
        dims.append(text)
    if seq_place is not None:
        d = seq_place[0]
        dims[d] = f"{dims[d]}/{tp}" if re.fullmatch(r"\w+", dims[d]) else f"({dims[d]})/{tp}"
    dtype = str(val.dtype).removeprefix("torch.")
    where = module_path(node) or f"{node.name} (root module)"
    return f"{where}: ({', '.join(dims)}) {dtype}"
