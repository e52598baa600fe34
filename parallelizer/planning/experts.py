"""Expert-parallel planner: which mixture-of-experts layers split their experts over ep.

Reads the expert layers the analysis found on the graph (:mod:`parallelizer.analysis.experts`:
stacked weights read by grouped matmuls, the region between them, the router) and decides,
as data, the layers whose experts are split over ``mesh.ep`` ranks; the expert_parallel pass
applies it. Every layer found is split (one ep degree for the model, as torchtitan and
Megatron-LM apply it); a model where ep cannot apply is an error naming the module.
"""
from __future__ import annotations

from ..analysis.experts import ExpertLayer, Unsupported
from ..errors import PlanError
from ..plan.decisions import EPDecision


def plan_ep(layers: list[ExpertLayer], unsupported: list[Unsupported], ep: int) -> EPDecision:
    """The EP decision for ``mesh.ep = ep`` (at ep = 1: off, the layers only reported).

    Raises:
        PlanError: ep > 1 and the model has no expert layer, or a stacked expert weight is
            read by something other than a grouped matmul (names the module, the op and the
            source line), or ep does not divide a layer's experts (names the module, E and the
            ep degrees that would).
    """
    decision = EPDecision(ep=ep)
    found = [f"experts of {l.module}: {l.num_experts} x ({', '.join(l.weights)}); router "
             f"{l.router or 'not found'}; grouped matmuls {', '.join(l.matmuls)}" for l in layers]
    if ep == 1:
        decision.report = [f"expert layer (replicated, mesh.ep = 1): {f}" for f in found]
        return decision
    if unsupported:
        u = unsupported[0]
        raise PlanError(f"mesh.ep={ep}: the experts of {u.module} ({u.weight}) are {u.reason}; "
                        f"expert parallelism splits stacked expert weights read by a grouped "
                        f"matmul (transformers' grouped_mm experts implementation: "
                        f"config._experts_implementation = 'grouped_mm'). Fix: use that "
                        f"implementation, or set mesh.ep=1.")
    if not layers:
        raise PlanError(f"mesh.ep={ep} but the model has no mixture-of-experts layer: no "
                        f"parameter of shape (experts, in, out) is read by a grouped matmul "
                        f"(rows sorted by expert, the stacked weight, cumulative rows per "
                        f"expert). Fix: set mesh.ep=1.")
    for l in layers:
        if l.num_experts % ep:
            valid = [d for d in range(1, l.num_experts + 1) if l.num_experts % d == 0]
            raise PlanError(f"mesh.ep ({ep}) must divide the number of experts ({l.num_experts}) "
                            f"of {l.module}; valid choices: ep in {{{', '.join(map(str, valid))}}}")
        decision.layers.append({
            "module": l.module, "experts": l.num_experts, "weights": list(l.weights),
            "offsets": l.offsets, "inputs": list(l.inputs), "outputs": list(l.outputs),
            "matmuls": list(l.matmuls), "region": list(l.region), "router": l.router})
    decision.report = [f"expert parallel over ep={ep} ({l.num_experts // ep} experts per rank): {f}"
                       for l, f in zip(layers, found)]
    return decision


def ep_summary(decision: EPDecision) -> str:
    """The compile's one line on expert parallelism."""
    n = len(decision.layers)
    return (f"expert parallel: {n} mixture-of-experts layer{'s' * (n != 1)} split over "
            f"ep={decision.ep} (all-to-all dispatch, dropless)")
