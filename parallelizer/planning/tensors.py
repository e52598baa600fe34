"""Build the ParallelPlan from the decisions and the split graphs (data only)."""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.fx as fx

from torch.utils._pytree import treespec_dumps

from ..passes.graph_facts import attr_targets
from ..pipeline_schedules import stage_ranks
from ..plan import ParallelPlan, StagePlan, TensorPlan
from ..errors import PlanError
from .tp import TPDecision


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names sharing one tensor, first name canonical (``[[embed.weight, lm_head.weight]]``)."""
    by_id: dict = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return [g for g in by_id.values()]


def _placement(name: str, tp: TPDecision) -> tuple:
    """(tp_dim, role, layout) of one tensor under the TP decision."""
    layout = tp.layouts.get(name)
    if name in tp.column:
        return tp.dims[name], "column_parallel", layout
    if name in tp.row:
        return tp.dims[name], "row_parallel", layout
    if name in tp.per_head:
        return tp.dims[name], "per-head (sharded along heads)", None
    for w, b in tp.biases.items():
        if b == name and w in tp.column:
            return tp.dims[name], "column_parallel", layout
        if b == name and w in tp.row:
            return None, "row_parallel bias (added after the all-reduce)", None
    return None, "replicate", None


def _check_sharing(owned: list, canonical: dict, stage: int) -> None:
    """One tensor read by two emitted modules of one stage (blocks sharing weights, as in
    ALBERT) would become two parameters with split gradients: refuse it at compile time.

    Raises:
        PlanError: names the tensor and the modules sharing it.
    """
    owners: dict = {}
    for owner, name in owned:
        owners.setdefault(canonical.get(name, name), {})[owner or "<stage root>"] = name
    for fqn, by in owners.items():
        if len(by) > 1:
            raise PlanError(
                f"{fqn} is shared by {', '.join(sorted(by))} (stage {stage}); weights shared "
                f"across blocks (ALBERT-style) are not supported yet: give each block its own "
                f"weights, or share only between the embedding and the LM head")


def build_plan(spec, captured, gm, model, groups, tp: TPDecision, stages, block_graphs) -> ParallelPlan:
    canonical = {n: g[0] for g in groups for n in g}
    p = spec.pipeline
    ranks = stage_ranks(p.schedule, spec.mesh.pp, p.virtual_stages)
    assert len(ranks) == len(stages), (len(ranks), len(stages))
    aliases = {n: g[0] for g in groups for n in g[1:]}
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    seen: dict = {}
    stage_plans = []
    for st, blocks in zip(stages, block_graphs):
        owned = [("", t) for t in attr_targets(st.graph)]
        owned += [(b.fqn, f"{b.fqn}.{t}") for b in blocks for t in attr_targets(b.graph)]
        _check_sharing(owned, canonical, st.index)
        fqns = []
        for _owner, name in owned:
            fqn = canonical.get(name, name)
            seen.setdefault(fqn, set()).add(st.index)
            if fqn not in fqns:
                fqns.append(fqn)
        stage_plans.append(StagePlan(st.index, f"stage{st.index}", tuple(fqns), tuple(st.inputs),
                                     tuple(st.outputs), tuple(b.fqn for b in blocks),
                                     ranks[st.index]))
    tensors = {}
    for fqn, stage_set in seen.items():
        t = attrgetter(fqn)(gm)
        # the TP planner saw the graph before untie, which may read a tied weight by an alias
        names = [fqn] + [n for n, c in canonical.items() if c == fqn and n != fqn]
        tp_dim, role, layout = next((_placement(n, tp) for n in names
                                     if _placement(n, tp)[0] is not None), _placement(fqn, tp))
        tensors[fqn] = TensorPlan(fqn, tuple(t.shape), str(t.dtype).removeprefix("torch."), tp_dim,
                                  tuple(sorted(stage_set)), fqn not in params, role, layout)
    return ParallelPlan(
        mesh={"pp": spec.mesh.pp, "dp": spec.mesh.dp, "tp": spec.mesh.tp},
        zero_stage=spec.zero_stage, schedule=spec.pipeline.schedule,
        microbatches=spec.pipeline.microbatches, seed=spec.seed, tensors=tensors,
        aliases={a: c for a, c in aliases.items()}, stages=tuple(stage_plans),
        input_names=captured.input_names, inputs_are_kwargs=captured.inputs_are_kwargs,
        out_spec=treespec_dumps(captured.out_spec), tp_report=tuple(tp.report),
        activation_checkpointing=spec.activation_checkpointing.mode,
        checkpoint_every=spec.activation_checkpointing.every, virtual_stages=p.virtual_stages,
        dp_replicate=spec.mesh.dp_replicate,
        prefetch_forward=_default(spec.fsdp.prefetch.forward, 1),
        prefetch_backward=_default(spec.fsdp.prefetch.backward, 1),
        offload=spec.fsdp.offload, param_dtype=spec.mixed_precision.param_dtype,
        reduce_dtype=spec.mixed_precision.reduce_dtype or spec.mixed_precision.param_dtype)


def _default(value, default):
    return default if value is None else value


def pipeline_structure(graph: fx.Graph, model, blocks, costs, canonical: dict) -> dict:
    """What re-partitioning a checkpoint for another pp degree needs, without the model
    (ParallelPlan.structure, read by checkpoint/target.py).

    ``uses[fqn]`` lists the cost-model units of the tensor's readers, direct or through
    values each stage recomputes (``passes.recompute``: Llama's ``inv_freq`` is read by every
    stage that uses the rotary tables) (0 before the blocks,
    1 + i for block i, len(blocks) + 1 after; ``graph_costs.assign_units``, the mapping
    split_stages uses), and ``part_uses[fqn]`` the block parts (direct child FQNs,
    ``graph_costs.assign_parts``) of its readers inside blocks that may be cut, so a
    tensor's stages under any partition are the stages of its units, or of its parts in a
    block cut across stages. ``block_costs``/``pre_cost``/``post_cost``/``block_parts`` are
    what ``plan_from_costs`` gives the partitioner; ``state_dict_keys`` are the model's own
    names, for export.
    """
    from ..passes.graph_costs import assign_parts, assign_units
    from ..passes.graph_facts import RUNTIME_DEVICE
    from ..passes.recompute import Recompute
    unit_of = assign_units(graph, tuple(blocks))
    child_of = assign_parts(graph, tuple(blocks), unit_of)
    recompute = Recompute(graph)
    uses: dict = {}
    part_uses: dict = {}
    for node in graph.nodes:
        if node.op != "get_attr" or node.target == RUNTIME_DEVICE:
            continue
        fqn = canonical.get(node.target, node.target)
        readers = recompute.readers(node)
        uses.setdefault(fqn, set()).update(unit_of[u] for u in readers if u in unit_of)
        kids = {child_of[u] for u in readers if u in child_of}
        if kids:
            part_uses.setdefault(fqn, set()).update(kids)
    return {"blocks": list(blocks), "block_costs": [u.flops for u in costs.blocks],
            "pre_cost": costs.units[0].flops, "post_cost": costs.units[-1].flops,
            "block_parts": [[list(p) for p in runs] for runs in costs.block_parts()],
            "uses": {k: sorted(v) for k, v in sorted(uses.items())},
            "part_uses": {k: sorted(v) for k, v in sorted(part_uses.items())},
            "state_dict_keys": list(model.state_dict().keys())}
