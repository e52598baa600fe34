"""Build the ParallelPlan from the graph facts and the planners' decisions, before any
rewrite (data only; docs/architecture.md)."""
from __future__ import annotations

import dataclasses
from operator import attrgetter

import torch
import torch.fx as fx


from ..analysis.graph_facts import RUNTIME_DEVICE, attr_targets
from ..analysis.needed_imports import modules_needed
from ..analysis.input_bounds import size_ranges
from ..analysis.outputs import (fixed_sizes, scalar_outputs, sequence_dims, size_guards,
                                static_dims)
from ..analysis.partition import GraphPartition
from ..checkpoint.format import safetensors_dtype
from ..errors import CheckpointError, PlanError
from ..plan.compression import plan_settings, reduce_dtype as compression_reduce_dtype
from ..plan.schedules import stage_ranks
from ..plan.parallel_plan import (MODEL_MODULE, ParallelPlan, StagePlan, TensorPlan,
                                  checkpointed_blocks, grad_sync_groups)
from ..plan.decisions import EPDecision, PipelineDecision, TPDecision, VocabDecision
from ..plan.experts import Experts
from ..plan.out_spec import dumps as out_spec_dumps
from .stages import tensor_stages
from .vocab import tp_report


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names sharing one tensor, first name canonical (``[[embed.weight, lm_head.weight]]``)."""
    by_id: dict = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return [g for g in by_id.values()]


def alias_map(groups: list[list[str]], include_canonical: bool = True) -> dict[str, str]:
    """Every name of each :func:`tied_groups` group -> the group's first (canonical) name (a
    name shared by no other maps to itself); without ``include_canonical`` the aliases only
    (``ParallelPlan.aliases``)."""
    return {n: g[0] for g in groups for n in (g if include_canonical else g[1:])}


def _placement(name: str, tp: TPDecision, vocab: VocabDecision) -> tuple:
    """(tp_dim, role, layout) of one tensor under the TP and vocab_parallel decisions."""
    if name in vocab.vocab:
        return vocab.dims[name], "vocab_parallel", vocab.layouts.get(name)
    layout = tp.layouts.get(name)
    if name in tp.column:
        return tp.dims[name], "column_parallel", layout
    if name in tp.row:
        return tp.dims[name], "row_parallel", layout
    if name in tp.per_head:
        return (tp.dims[name], "per-head or per-channel (sharded with the heads or channels it "
                "meets)", None)
    w = tp.masks.get(name)
    if w is not None:
        return (tp.dims[name], f"{'column' if w in tp.column else 'row'}_parallel mask "
                f"(multiplied into {w})", layout)
    w = tp.biases.get(name)
    if w in tp.column:
        return tp.dims[name], "column_parallel", layout
    if w in tp.row:
        return None, "row_parallel bias (added after the all-reduce)", None
    return None, "replicate", None


def build_plan(spec, captured, gm, model, groups, tp: TPDecision, vocab: VocabDecision,
               dropout: tuple, pipe: PipelineDecision, structure: dict,
               ep: EPDecision | None = None, random: tuple = ()) -> ParallelPlan:
    """The whole plan, before any rewrite: placements from the TP and vocab_parallel
    decisions, stages of every tensor from the pipeline decision
    (:func:`~parallelizer.planning.stages.tensor_stages`, the function ``reshard --pp``
    uses), the blocks of each stage and which of them are activation-checkpointed, the
    dropout streams, what run.py imports, and the run-time settings. Stage boundary names
    are left empty: ``passes/split_check.py`` records them from the split graphs and checks
    that those hold exactly the tensors and blocks planned here.

    Args:
        gm: the captured graph module (global shapes), for each tensor's shape and dtype.
        dropout: the DropoutSite records of planning/dropout.py.
        structure: :func:`pipeline_structure` of the captured graph.
        ep: the expert-parallel decision (planning/experts.py): its stacked weights get the
            ``experts`` layout (dim 0 over ep), and those it splits over tp their FFN dim as
            ``tp_dim`` (with a fused gate | up layout).
    """
    ep = ep or EPDecision()
    experts = Experts(ep.ep) if ep.ep > 1 else None
    canonical = alias_map(groups)
    p = spec.pipeline
    ranks = stage_ranks(p.schedule, spec.mesh.pp, p.virtual_stages)
    assert len(ranks) == pipe.num_stages, (len(ranks), pipe.num_stages)
    # the model's, and those a pass made (stacked experts, passes/stack_experts.py)
    params = {**dict(model.named_parameters(remove_duplicate=False)), **dict(gm.named_parameters())}
    # tensors some node reads (export may leave a get_attr nothing uses: no stage holds it)
    order = [f for f in dict.fromkeys(canonical.get(t, t) for t in attr_targets(gm.graph))
             if structure["uses"].get(f) or structure.get("part_uses", {}).get(f)]
    stages_of = tensor_stages(pipe, structure["uses"], structure.get("part_uses", {}))
    tensors = {}
    for fqn in order:
        t = attrgetter(fqn)(gm)
        _check_storable(fqn, t.dtype)
        # a tied weight may be read under an alias in the graph
        names = [fqn] + [n for n, c in canonical.items() if c == fqn and n != fqn]
        tp_dim, role, layout = next((_placement(n, tp, vocab) for n in names
                                     if _placement(n, tp, vocab)[0] is not None),
                                    _placement(fqn, tp, vocab))
        if fqn in ep.dims:  # an expert weight split over tp along its FFN dim
            tp_dim, role, layout = ep.dims[fqn], "experts", ep.layouts.get(fqn)
        is_expert = experts is not None and fqn in ep.weights
        tensors[fqn] = TensorPlan(fqn, tuple(t.shape), str(t.dtype).removeprefix("torch."), tp_dim,
                                  stages_of.get(fqn, (0,)), fqn not in params,
                                  "experts" if is_expert else role, layout,
                                  experts if is_expert else None,
                                  fqn in params and not params[fqn].requires_grad)
    stage_plans = tuple(
        StagePlan(s, f"stage{s}", tuple(f for f in order if s in tensors[f].stages), (), (),
                  tuple(pipe.blocks[i] for i in pipe.block_range(s)), ranks[s])
        for s in range(pipe.num_stages))
    ac = spec.activation_checkpointing
    plan = ParallelPlan(
        mesh={"pp": spec.mesh.pp, "dp": spec.mesh.dp, "tp": spec.mesh.tp},
        zero_stage=spec.zero_stage, schedule=spec.pipeline.schedule,
        microbatches=spec.pipeline.microbatches, seed=spec.seed, tensors=tensors,
        # a tied group forward never reads (LUKE's entity embeddings and head without entity
        # inputs) has no tensor, so no alias: the manifest's aliases name tensors it holds
        aliases={a: c for a, c in alias_map(groups, include_canonical=False).items()
                 if c in tensors}, stages=stage_plans,
        input_names=captured.input_names, inputs_are_kwargs=captured.inputs_are_kwargs,
        out_spec=out_spec_dumps(captured.out_spec), tp_report=tuple(tp_report(tp, vocab)),
        activation_checkpointing=ac.mode, checkpoint_every=ac.every,
        checkpointed=checkpointed_blocks(pipe.blocks, ac.mode, ac.every),
        virtual_stages=p.virtual_stages, dp_replicate=spec.mesh.dp_replicate,
        prefetch_forward=_default(spec.fsdp.prefetch.forward, 1),
        prefetch_backward=_default(spec.fsdp.prefetch.backward, 1),
        offload=spec.fsdp.offload, param_dtype=spec.mixed_precision.param_dtype,
        reduce_dtype=compression_reduce_dtype(spec), compression=plan_settings(spec),
        structure=structure, settings=run_settings(spec, token_vocab(gm)),
        imports=modules_needed(gm.graph, captured.out_spec, MODEL_MODULE),
        scalar_outputs=scalar_outputs(gm), vocab_outputs=tuple(sorted(vocab.outputs.items())),
        fixed_sizes=tuple(f[:3] for f in fixed_sizes(gm, captured.input_names)),
        static_dims=static_dims(gm, captured.input_names),
        size_ranges=size_ranges(gm, captured.input_names),
        size_guards=size_guards(gm, captured.input_names),
        sequence_dims=sequence_dims(gm, captured.input_names),
        dropout=tuple(dataclasses.asdict(d) for d in dropout),
        random=tuple(dataclasses.asdict(r) for r in random), ep=ep.ep,
        expert_layers=tuple({k: layer[k] for k in ("module", "experts", "weights", "router")}
                            for layer in ep.layers))
    partial = tuple(sorted({canonical.get(f, f) for f in tp.partial}))
    return dataclasses.replace(plan, grad_sync=grad_sync_groups(plan, partial))


def _check_storable(fqn: str, dtype) -> None:
    """Every planned tensor goes into the program's safetensors checkpoint.

    Raises:
        PlanError: ``dtype`` has no safetensors form: names the tensor, its dtype and the fix.
    """
    try:
        safetensors_dtype(dtype)
    except CheckpointError as e:
        raise PlanError(f"{fqn}: {e}; the program's checkpoint cannot hold it: cast it to one "
                        f"of those in build_model(), or compute it in forward") from None


def run_settings(spec, vocab_size: int | None = None) -> dict:
    """The spec's sections run.py reads (``ParallelPlan.settings``); ``data.vocab_size``:
    the rows of the embedding the token ids index (:func:`token_vocab`), which token data
    is checked against."""
    return {"optimizer": spec.optimizer.model_dump(), "verify": spec.verify.model_dump(),
            "train": spec.train.model_dump(), "compile": spec.compile,
            "data": {**spec.data.model_dump(), "vocab_size": vocab_size}}


def token_vocab(gm: fx.GraphModule) -> int | None:
    """The vocabulary of the model's token-id input: the rows of the embedding weight that
    ``aten.embedding`` looks the first integer input up in (None when there is none). Read
    from the captured graph (global shapes), before any rewrite."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"
              and getattr(n.meta.get("val"), "dtype", None) in (torch.int64, torch.int32)]
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default \
                and inputs and node.args[1] is inputs[0]:
            weight = node.args[0].meta.get("val")
            return int(weight.shape[0]) if weight is not None else None
    return None


def _default(value, default):
    return default if value is None else value


def pipeline_structure(graph: fx.Graph, model, blocks, costs, canonical: dict,
                       partition=None) -> dict:
    """What re-partitioning a checkpoint for another pp degree needs, without the model
    (ParallelPlan.structure, read by convert/target.py).

    ``uses[fqn]`` lists the cost-model units of the tensor's readers, direct or through
    values each stage recomputes (``analysis.recompute``: Llama's ``inv_freq`` is read by every
    stage that uses the rotary tables) (0 before the blocks,
    1 + i for block i, len(blocks) + 1 after; ``analysis/partition.assign_units``, the mapping
    split_stages uses), and ``part_uses[fqn]`` the block parts (direct child FQNs,
    ``assign_parts``) of its readers inside blocks that may be cut, so a
    tensor's stages under any partition are the stages of its units, or of its parts in a
    block cut across stages. ``block_costs``/``pre_cost``/``post_cost``/``block_parts`` are
    what ``plan_from_costs`` gives the partitioner; ``state_dict_keys`` are the model's own
    names, for export.
    """
    partition = partition or GraphPartition.of(graph, tuple(blocks))
    unit_of, child_of, recompute = partition.unit_of, partition.child_of, partition.recompute
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
