"""Expert-parallel planner: which mixture-of-experts layers split their experts over ep.

Reads the expert layers the analysis found on the graph (:mod:`parallelizer.analysis.experts`:
stacked weights read by grouped matmuls, the region between them, the router) and decides,
as data, the layers whose experts are split over ``mesh.ep`` ranks; the expert_parallel pass
applies it. Every layer found is split (one ep degree for the model, as torchtitan and
Megatron-LM apply it); a model where ep cannot apply is an error naming the module.

At ``mesh.tp`` > 1 it also splits each layer's FFN dim over tp (Megatron's MLP split inside
every expert, :mod:`parallelizer.analysis.expert_ffn`): the first projection (gate | up)
column parallel, the last (down) row parallel, with or without ep. A layer tp cannot split
(a blocker the analysis names, or a size tp does not divide) keeps its experts whole on
every tp rank, as before, and report.md says why.
"""
from __future__ import annotations

from ..analysis.expert_ffn import ExpertFFN
from ..analysis.experts import ExpertLayer, Unsupported
from ..errors import PlanError
from ..plan.decisions import EPDecision
from ..plan.layouts import Fused


def plan_ep(layers: list[ExpertLayer], unsupported: list[Unsupported], ep: int, tp: int = 1,
            ffn: list[ExpertFFN] | None = None) -> EPDecision:
    """The EP decision for ``mesh.ep = ep`` (at ep = 1: off, the layers only reported), and
    at ``tp`` > 1 the tp split of each layer's FFN dim (``ffn``: the facts of each layer, in
    the order of ``layers``; see :func:`plan_expert_tp`).

    Raises:
        PlanError: ep > 1 and the model has no expert layer, or a stacked expert weight is
            read by something other than a grouped matmul (names the module, the op and the
            source line), or ep does not divide a layer's experts (names the module, E and the
            ep degrees that would).
    """
    decision = EPDecision(ep=ep, tp=tp)
    found = [f"experts of {l.module}: {l.num_experts} x ({', '.join(l.weights)}); router "
             f"{l.router or 'not found'}; grouped matmuls {', '.join(l.matmuls)}" for l in layers]
    split = plan_expert_tp(decision, layers, ffn or [], tp)
    if ep == 1:
        decision.report = [f"expert layer (mesh.ep = 1: every rank holds all its experts): {f}" for f in found] + \
            decision.report
        decision.layers = [_layer(l, True, split[l.module]) for l in layers if l.module in split]
        return decision
    if unsupported:
        u = unsupported[0]
        raise PlanError(f"mesh.ep={ep}: the experts of {u.module} ({u.weight}) are {u.reason}; "
                        f"expert parallelism splits stacked expert weights read by a grouped "
                        f"matmul, or a list of identical bias-free expert modules it stacks "
                        f"into one. Fix: {u.fix}.")
    if not layers:
        raise PlanError(f"mesh.ep={ep} but the model has no mixture-of-experts layer: no "
                        f"parameter of shape (experts, in, out) is read by a grouped matmul "
                        f"(rows sorted by expert, the stacked weight, cumulative rows per "
                        f"expert), and no list of expert modules runs on rows of its own. "
                        f"Fix: set mesh.ep=1.")
    for l in layers:
        if l.num_experts % ep:
            valid = [d for d in range(1, l.num_experts + 1) if l.num_experts % d == 0]
            raise PlanError(f"mesh.ep ({ep}) must divide the number of experts ({l.num_experts}) "
                            f"of {l.module}; valid choices: ep in {{{', '.join(map(str, valid))}}}")
        decision.layers.append(_layer(l, l.module in split, split.get(l.module, ())))
    decision.report = [f"expert parallel over ep={ep} ({l.num_experts // ep} experts per rank): {f}"
                       for l, f in zip(layers, found)] + decision.report
    return decision


def _layer(l: ExpertLayer, tp: bool, split_rows=()) -> dict:
    """The layer as the expert_parallel pass reads it; ``split_rows``: inputs already split
    over tp along the features (a bias's rows), which get no f."""
    return {"module": l.module, "experts": l.num_experts, "weights": list(l.weights),
            "offsets": l.offsets, "inputs": list(l.inputs), "outputs": list(l.outputs),
            "matmuls": list(l.matmuls), "region": list(l.region), "router": l.router, "tp": tp,
            "split_rows": sorted(split_rows)}


def plan_expert_tp(decision: EPDecision, layers: list[ExpertLayer], ffn: list[ExpertFFN],
                   tp: int) -> dict:
    """Record in ``decision`` the tp split of every layer that takes one; returns their
    modules, each with the inputs that arrive split (its biases' rows). A layer is split
    when the analysis found no blocker and tp divides its weights' FFN dims (times the step
    of a strided slice of them), every part the region cuts them into and every explicit
    size along them: its gate | up weight gets the :class:`Fused` layout of its parts (each
    rank holds its block of each part, so the region's own chunk gives it matching gate and
    up blocks), a bias added to its output the same split, its down weight the even split of
    the dim it contracts. Otherwise report.md says why it stays
    whole on every tp rank (still correct: every rank computes all of it)."""
    split: dict = {}
    if tp == 1:
        return split
    for layer, facts in zip(layers, ffn):
        why = facts.blocker or _indivisible(facts, tp)
        if why:
            decision.report.append(f"experts of {layer.module} kept whole on every tp rank: {why}")
            continue
        split[layer.module] = tuple(facts.bias_rows)
        decision.dims.update(facts.column)
        decision.dims.update(facts.row)
        for w, parts in facts.parts.items():
            if parts is not None and len(parts) > 1:
                decision.layouts[w] = Fused(tuple(parts))
        for b, (w, dim) in facts.biases.items():  # split as the features it is added to
            decision.dims[b] = dim
            if w in decision.layouts:
                decision.layouts[b] = decision.layouts[w]
        for node, arg, index, size in facts.sizes:
            decision.rewrites.setdefault(node, []).append((arg, index, size // tp))
        decision.report.append(f"experts of {layer.module} split over tp={tp} along their FFN "
                               f"dim: {_roles(facts, decision)}; f on the rows entering the "
                               f"experts, one all-reduce (g) of their output before the combine")
    return split


def _roles(facts: ExpertFFN, decision: EPDecision) -> str:
    col = [f"{w} column_parallel (dim {d}"
           + (f", fused parts {list(decision.layouts[w].parts)})" if w in decision.layouts else ")")
           for w, d in facts.column.items()]
    bias = [f"{b} with {w} (dim {d})" for b, (w, d) in facts.biases.items()]
    return "; ".join(col + [f"{w} row_parallel (dim {d})" for w, d in facts.row.items()] + bias)


def _indivisible(facts: ExpertFFN, tp: int) -> str:
    for w, n in facts.widths.items():
        if n % tp:
            return f"mesh.tp ({tp}) does not divide the {n} FFN features of {w}"
    for w, step in facts.strides.items():
        if facts.widths[w] % (tp * step):
            return (f"mesh.tp ({tp}) x the step {step} of the strided slices of {w}'s output "
                    f"does not divide its {facts.widths[w]} FFN features")
    for w, parts in facts.parts.items():
        for p in parts or ():
            if p % tp:
                return f"mesh.tp ({tp}) does not divide the part of {p} features of {w}"
    for node, _arg, _i, size in facts.sizes:
        if size % tp:
            return f"mesh.tp ({tp}) does not divide the size {size} of {node} along the FFN dim"
    return ""


def ep_summary(decision: EPDecision) -> str:
    """The compile's one line on expert parallelism and the experts' tp split ('' for
    neither)."""
    n = len(decision.layers)
    parts = []
    if decision.ep > 1:
        parts.append(f"expert parallel: {n} mixture-of-experts layer{'s' * (n != 1)} split over "
                     f"ep={decision.ep} (all-to-all dispatch, dropless)")
    split = sum(1 for layer in decision.layers if layer["tp"])
    if split:
        parts.append(f"experts: {split} mixture-of-experts layer{'s' * (split != 1)} split over "
                     f"tp={decision.tp} along their FFN dim")
    return "; ".join(parts)
