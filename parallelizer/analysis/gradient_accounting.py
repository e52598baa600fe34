"""Gradient accounting of the rewritten program: every parameter's gradient, derived on the
final stage graphs (:func:`parallelizer.analysis.gradients.derive` with the operators the
passes inserted, :class:`~parallelizer.analysis.gradient_forward.ProgramForward`), must be
what the optimizer may take as it is, once the plan's gradient syncs have run:

- a replicated parameter: whole (Replicate), or Partial over tp and summed by a
  ``partial_tp`` entry of ``plan.grad_sync`` (never summed when already whole: that would
  be tp times the gradient);
- a sharded parameter: whole on its shard (Shard(tp_dim)); copied kv heads (layout
  ``replicated_heads``, or such parts of a fused tensor) summed by a ``replicated_heads``
  entry for their head count;
- a weight held by stages on several pp ranks: summed by a ``tied`` entry for those stages;
- never Mixed.

Stage graphs are analysed as the pipeline runs them: forward placements from the first
stage to the last (a stage's inputs are its predecessor's outputs), cotangents from the last
to the first. A violation is a bug of the compiler (the planner derived the syncs from the
same rules on the captured graph), reported before anything is written.
"""
from __future__ import annotations

from ..errors import PlanError
from ..plan.layouts import copied_heads
from .gradient_forward import ProgramForward
from .gradients import MIXED, PARTIAL, WHOLE, carries, derive

_BUG = "internal error (a bug in parallelizer, please report it): "
_WORKAROUND = "; compile with mesh.tp=1 meanwhile"


def check_gradients(plan, stages: list) -> None:
    """Check every parameter gradient of ``stages`` (split_stages' StageGraphs, before
    split_blocks outlines them) against ``plan.grad_sync``.

    Raises:
        PlanError: a gradient left Partial, Mixed, summed twice, or a copy left unsummed;
            names the parameter FQN, the op and the model's source line.
    """
    if plan.mesh["tp"] == 1 and plan.mesh["pp"] == 1:
        return
    flows = _flows(plan, stages)
    partial = {f for e in plan.grad_sync if e["kind"] == "partial_tp" for f in e["key"]}
    for st, flow in zip(stages, flows):
        for target, cot in flow.params.items():
            fqn = plan.aliases.get(target, target)
            tplan = plan.tensors.get(fqn)
            if tplan is not None and not tplan.is_buffer:
                _check_one(fqn, tplan, cot, flow, partial, st.index)
    _check_copies(plan)


def _flows(plan, stages: list) -> list:
    """Each stage's GradientFlow, placements forward then cotangents backward."""
    fwd = ProgramForward(plan)
    grad_in, out_vary, out_carry = [], [], []
    for st in stages:
        phs = [n.name for n in st.graph.nodes if n.op == "placeholder"]
        vary_in = out_vary or [False] * len(phs)
        carrying = frozenset(n for n, g in zip(phs, out_carry) if g)
        out_vary = fwd.run(st.graph, vary_in)
        c = carries(list(st.graph.nodes), carrying)
        out = next(n for n in st.graph.nodes if n.op == "output")
        flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        out_carry = [bool(c.get(a)) for a in flat]
        grad_in.append(carrying)
    flows, cots = [None] * len(stages), None
    for i in reversed(range(len(stages))):
        flows[i] = derive(stages[i].graph, fwd, outputs=cots, grad_inputs=grad_in[i],
                          place_f=False)
        cots = flows[i].inputs
    return flows


def _check_one(fqn: str, tplan, cot, flow, partial: set, stage: int) -> None:
    where = flow.where(cot.origin)
    if cot.kind == MIXED:
        raise PlanError(f"{_BUG}the gradient of {fqn} (stage {stage}) is Mixed over tp: "
                        f"{cot.why}, at {where}{_WORKAROUND}")
    if tplan.tp_dim is not None:
        if fqn in partial:
            raise PlanError(f"{_BUG}plan.grad_sync sums the gradient of {fqn} (stage {stage}) "
                            f"over tp, but it is sharded on dim {tplan.tp_dim}: each rank "
                            f"holds another piece{_WORKAROUND}")
        if cot.kind != WHOLE:
            raise PlanError(f"{_BUG}the gradient of {fqn} (stage {stage}, sharded on dim "
                            f"{tplan.tp_dim}) is Partial over tp at {where}{_WORKAROUND}")
        return
    if cot.kind == PARTIAL and fqn not in partial:
        raise PlanError(f"{_BUG}the gradient of {fqn} (stage {stage}) is Partial over tp "
                        f"(each tp rank holds only its shard's contribution: it is read by "
                        f"{where}) but plan.grad_sync has no partial_tp entry summing it"
                        f"{_WORKAROUND}")
    if cot.kind == WHOLE and fqn in partial:
        raise PlanError(f"{_BUG}plan.grad_sync sums the gradient of {fqn} (stage {stage}) "
                        f"over tp, but it is already whole on every rank (it would be tp "
                        f"times too large){_WORKAROUND}")


def _check_copies(plan) -> None:
    """Copied kv heads and tied weights across pp ranks have their sum in plan.grad_sync."""
    heads = {e["key"] for e in plan.grad_sync if e["kind"] == "replicated_heads"}
    tied = {tuple(e["key"]) for e in plan.grad_sync if e["kind"] == "tied"}
    rank_of = {st.index: st.rank for st in plan.stages}
    for fqn, t in sorted(plan.tensors.items()):
        if t.is_buffer:
            continue
        missing = [k for k in copied_heads(t.layout) if k not in heads]
        if missing:
            raise PlanError(f"{_BUG}{fqn} holds copies of {missing[0]} kv head(s) "
                            f"(layout {t.layout.text()}) but plan.grad_sync has no "
                            f"replicated_heads entry summing them{_WORKAROUND}")
        on = {rank_of.get(s, s) for s in t.stages}
        if len(on) > 1 and tuple(t.stages) not in tied:
            raise PlanError(f"{_BUG}{fqn} is held by stages {list(t.stages)} on pp ranks "
                            f"{sorted(on)} but plan.grad_sync has no tied entry summing its "
                            f"copies{_WORKAROUND}")
