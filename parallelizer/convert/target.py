"""The (tp, pp) layout a checkpoint converts to, computed from the checkpoint alone.

- tp: every tensor keeps its ``tp_dim`` and layout kind (:mod:`parallelizer.plan.layouts`);
  :func:`relayout` adapts the layout's degree-dependent parts (each layout's ``adapt``:
  replicated kv heads turn into an even split when tp <= kv heads and back; vocab padding
  is recomputed) and refuses degrees that do not fit, naming the tensor and the tp values
  that do.
- pp: the manifest carries ``structure`` (ParallelPlan.structure): the blocks, the costs the
  compiler gave the pipeline partitioner (FLOPs of the cost model) and, per tensor, the
  cost-model units of its readers (0 before the blocks, 1 + i block i, n + 1 after), the
  blocks' parts (runs of direct children, for cuts inside a block) and the parts of its
  readers inside blocks. A
  split fixed by ``pipeline.split_points``/``layers_per_stage`` is not reproduced (those name
  one pp): pass ``--plan OUT`` of the program compiled with it.
  :func:`repartition` calls the same partitioner (planning/pipeline.py) through
  :func:`_partition`, so a program compiled for the new pp expects exactly these stages.
  The target has ``virtual_stages`` stages per pp rank (default 1): ``pp x virtual_stages``
  stages from the same partitioner (files are per stage, so a program compiled for pp=P,
  ``pipeline.virtual_stages``=V under either placement reads them). A checkpoint keeps its
  stages when neither pp nor ``virtual_stages`` is asked to change.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from parallelizer.checkpoint.writer import FileLayout, optim_entry
from parallelizer.errors import CheckpointError, PlanError
from parallelizer.plan.layouts import EvenSplit, adapt, check, layout_from_json, layout_json
from parallelizer.plan.experts import Experts, experts_from_json
from parallelizer.plan.parallel_plan import TensorPlan
from parallelizer.planning.pipeline import plan_pipeline
from parallelizer.planning.stages import tensor_stages

_MAX_TP = 128


def source_layout(manifest: dict) -> FileLayout:
    """The checkpoint's own :class:`FileLayout`, rebuilt from its manifest (validated:
    :func:`parallelizer.checkpoint.reader.read_manifest`)."""
    tensors, params = {}, {}
    for name, e in manifest["tensors"].items():
        tensors[name] = TensorPlan(name, tuple(e["shape"]), e["dtype"], e["tp_dim"],
                                   tuple(e["stages"]), e["is_buffer"], e.get("role", "replicate"),
                                   layout_from_json(e.get("layout")),
                                   experts_from_json(e.get("experts")))
        if e.get("kind") == "optim":
            params[name] = e["param"]
    return FileLayout(dict(manifest["mesh"]), tensors, params, dict(manifest.get("aliases", {})),
                      dict(manifest.get("structure") or {}), manifest.get("plan_hash", ""),
                      manifest.get("train"), manifest.get("num_stages", manifest["mesh"]["pp"]))


def relayout(tplan: TensorPlan, tp: int) -> Optional[EvenSplit]:
    """``tplan.layout`` adapted to tp degree ``tp`` (:meth:`EvenSplit.adapt`).

    Raises:
        CheckpointError: ``tp`` does not fit the tensor; names it, its shape and layout and
            the tp values up to 128 that fit.
    """
    d = tplan.tp_dim
    if d is None:
        return None
    layout = adapt(tplan.shape[d], tplan.layout, tp)
    try:
        check(tplan.shape[d], layout, tp)
    except ValueError as e:
        fits = [t for t in range(1, _MAX_TP + 1) if _fits(tplan, t)]
        raise CheckpointError(
            f"tp={tp} does not fit {tplan.fqn} (shape {tplan.shape}, sharded on dim {d}, layout "
            f"{layout_json(tplan.layout) or 'even split'}): {e}; tp values that fit this tensor: "
            f"{', '.join(map(str, fits)) or 'none'}") from None
    return layout


def _fits(tplan: TensorPlan, tp: int) -> bool:
    n = tplan.shape[tplan.tp_dim]
    try:
        check(n, adapt(n, tplan.layout, tp), tp)
        return True
    except ValueError:
        return False


def _partition(structure: dict, pp: int):
    """The PipelineDecision for ``pp`` stages: the compiler's partitioner on the recorded
    costs and block parts (the one place to adapt when the partitioner's signature changes)."""
    parts = [[tuple(p) for p in runs] for runs in structure.get("block_parts") or []]
    return plan_pipeline(list(structure["block_costs"]), structure["pre_cost"],
                         structure["post_cost"], pp, tuple(structure["blocks"]), parts=parts)


def repartition(structure: dict, pp: int) -> dict[str, tuple[int, ...]]:
    """fqn -> stages holding it when the blocks are split into ``pp`` stages.

    Raises:
        CheckpointError: the checkpoint carries no pipeline structure (written from a plan
            compiled before it was recorded) or ``pp`` exceeds the number of blocks.
    """
    if not structure or "uses" not in structure:
        raise CheckpointError(
            "this checkpoint records no pipeline structure (manifest.json 'structure'), so its "
            "stages cannot be re-partitioned without the model; recompile the program and save "
            "the checkpoint again, or pass --plan OUT of a program compiled for the new mesh")
    try:
        decision = _partition(structure, pp)
    except PlanError as e:
        raise CheckpointError(f"--pp {pp}: {e}") from None
    return tensor_stages(decision, structure["uses"], structure.get("part_uses", {}))


def relayout_experts(tplan: TensorPlan, ep: Optional[int]) -> Optional[Experts]:
    """The ``experts`` layout of ``tplan`` at ep degree ``ep`` (None: kept as it is). An
    expert weight is one the compiler marked (role ``experts``); others have none. The files
    hold every expert whatever ep is: only the manifest's record changes.

    Raises:
        CheckpointError: ep does not divide the tensor's experts (names it and the ep
            values that do).
    """
    if ep is None or tplan.role != "experts":
        return tplan.experts
    n = tplan.shape[0]
    if n % ep:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise CheckpointError(f"--ep {ep} does not divide the {n} experts of {tplan.fqn}; "
                              f"ep values that fit: {', '.join(map(str, valid))}")
    return Experts(ep) if ep > 1 else None


def target_layout(manifest: dict, tp: int, pp: int, dp: Optional[int] = None,
                  virtual_stages: Optional[int] = None, ep: Optional[int] = None) -> FileLayout:
    """The checkpoint's tensors re-laid out for (tp, pp): same tp_dim and layout kind,
    stages from :func:`repartition` into ``pp x virtual_stages`` stages (``virtual_stages``
    None: 1, or the checkpoint's stages kept when pp is unchanged); optimizer state follows
    its parameter; expert weights recorded for ``ep`` (:func:`relayout_experts`).

    Raises:
        CheckpointError: from :func:`relayout`, :func:`relayout_experts` and :func:`repartition`.
    """
    src = source_layout(manifest)
    if virtual_stages is None and pp == src.mesh["pp"]:
        num_stages = src.stages()
    else:
        num_stages = pp * (virtual_stages or 1)
    keep = pp == src.mesh["pp"] and num_stages == src.stages()
    stages = None if keep else repartition(src.structure, num_stages)
    model = {}
    for fqn, t in src.model_tensors().items():
        st = t.stages if stages is None else stages.get(fqn)
        if st is None:
            raise CheckpointError(f"{fqn} is not in the checkpoint's pipeline structure; it "
                                  "cannot be placed on a stage without the model")
        try:
            model[fqn] = replace(t, layout=relayout(t, tp), stages=st,
                                 experts=relayout_experts(t, ep))
        except CheckpointError as e:
            sharded = [x for x in src.model_tensors().values() if x.tp_dim is not None]
            common = [d for d in range(1, _MAX_TP + 1) if all(_fits(x, d) for x in sharded)]
            raise CheckpointError(f"{e}; tp values that fit every tensor of this checkpoint: "
                                  f"{', '.join(map(str, common))}. A compile at tp={tp} may "
                                  f"still lay it out (kv heads tp does not divide are copied "
                                  f"to each rank): compile the model at that tp and pass the "
                                  f"program with --plan OUT") from None
    tensors = dict(model)
    for name, fqn in src.params.items():
        tensors[name] = optim_entry(model[fqn], name, src.tensors[name].dtype)
    mesh = {"pp": pp, "dp": src.mesh["dp"] if dp is None else dp, "tp": tp}
    return FileLayout(mesh, tensors, dict(src.params), src.aliases, src.structure, "", src.train,
                  num_stages)


def plan_layout(manifest: dict, plan) -> FileLayout:
    """The layout of a compiled program's ``plan`` for this checkpoint's tensors.

    Raises:
        CheckpointError: the plan's tensors differ from the checkpoint's (names, shapes or
            dtypes): the checkpoint is of another model.
    """
    src = source_layout(manifest)
    ours = src.model_tensors()
    diff = [f"{k}: checkpoint {ours[k].shape} {ours[k].dtype}, plan {v.shape} {v.dtype}"
            for k, v in sorted(plan.tensors.items()) if k in ours
            and (tuple(ours[k].shape) != tuple(v.shape) or ours[k].dtype != v.dtype)]
    missing, extra = sorted(set(plan.tensors) - set(ours)), sorted(set(ours) - set(plan.tensors))
    if diff or missing or extra:
        raise CheckpointError(
            f"the plan does not describe this checkpoint's model: missing {missing[:3]}, "
            f"unexpected {extra[:3]}, differing {diff[:3]}")
    tensors = dict(plan.tensors)
    if plan.mesh["tp"] == 1:  # a tp=1 plan has no placements: keep the checkpoint's for later
        tensors = {k: replace(v, tp_dim=ours[k].tp_dim, role=ours[k].role,
                              layout=relayout(ours[k], 1)) for k, v in tensors.items()}
    for name, fqn in src.params.items():
        tensors[name] = optim_entry(tensors[fqn], name, src.tensors[name].dtype)
    return FileLayout(dict(plan.mesh), tensors, dict(src.params), dict(plan.aliases),
                  dict(plan.structure) or src.structure, plan.hash(), src.train, plan.num_stages)
