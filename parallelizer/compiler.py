"""The compiler: model.py + spec -> Program (emitted source, plan, resharded weights).

``compile_model`` reads as the list of steps; each step is a planner (reads facts, returns
data) or a pass (reads a plan, rewrites the graph).
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from operator import attrgetter
from pathlib import Path
from typing import Optional

import torch

from .emit.stages import stage_sources
from .checkpoint.hf import load_hf_state_dict, match_to_model
from .errors import CheckpointError, PlanError
from .frontend.model_file import build_model, example_batch, load_model_file
from .frontend.capture import capture
from .analysis.needed_imports import modules_needed
from .analysis.outputs import check_outputs_have_batch_dim, scalar_outputs
from .passes.aliases import apply_untie
from .passes.attention import apply_eager_attention
from .passes.cleanup import apply_cleanup
from .passes.dropout import apply_rng_streams
from .passes.manager import PassManager
from .passes.split_blocks import split_blocks
from .passes.split_check import check_split
from .plan.parallel_plan import MODEL_MODULE
from .passes.split_stages import split_stages
from .passes.sequence_parallel import apply_sequence_parallel
from .passes.tensor_parallel import apply_tensor_parallel
from .passes.vocab_parallel import apply_vocab_parallel
from .analysis.graph_costs import collect_costs
from .analysis.partition import GraphPartition
from .planning.dropout import describe as describe_dropout, plan_dropout
from .planning.pipeline import find_blocks, plan_from_costs
from .planning.pipeline_summary import (check_microbatches, check_placement, summarize,
                                        virtual_stages_of)
from .planning.tensors import build_plan, pipeline_structure, tied_groups
from .planning.sequence import plan_sequence_parallel
from .planning.tp import plan_tp, tp_summary
from .planning.vocab import plan_vocab, vocab_summary
from .emit.program import Program
from .emit.reference import compute_reference
from .emit.report import render_report
from .runtime.loss import default_loss
from .frontend.spec import Spec


def compile_to_dir(model_path: Path, spec: Spec, out_dir: Path, weights: bool = True,
                   dump_passes: Optional[Path] = None, topology=None) -> None:
    """CLI entry: compile and write OUT/ atomically (nothing is written on error);
    the compiler's warnings go to stderr. ``topology`` (:class:`parallelizer.emit.launch.Topology`,
    default one node) gives OUT/launch.sh, OUT/launch.sbatch and report.md's placement table."""
    from .emit.launch import launch_files, one_node, placement_lines
    program = compile_model(Path(model_path), spec, weights, dump_passes)
    topology = topology or one_node(program.plan.mesh)
    program.sources.update(launch_files(topology))
    program.report += "\n".join(placement_lines(program.plan.mesh, topology)) + "\n"
    program.save(Path(out_dir))
    for line in program.notes:
        print(line)
    for line in program.warnings:
        print(f"warning: {line}", file=sys.stderr)


def compile_model(model_path: Path, spec: Spec, weights: bool = True,
                  dump_passes: Optional[Path] = None) -> Program:
    """Compile the model of a model.py file. ``weights=False`` builds it on the meta device
    and emits program and plan only (no checkpoint, no reference).

    Raises:
        ModelFileError, CaptureError, PlanError, CheckpointError: bad input, with the fix.
    """
    torch.manual_seed(spec.seed)
    module = load_model_file(model_path)
    model = build_model(module, on_meta=not weights)
    if weights and spec.checkpoint.path:
        _load_checkpoint(model, spec.checkpoint.path)
    batch = example_batch(module)
    loss_fn = getattr(module, "loss_fn", None) or default_loss
    return compile_module(model, batch, spec, loss_fn, model_file=Path(model_path),
                          dump_passes=dump_passes, owns_model=True)


def compile_module(model: torch.nn.Module, batch, spec: Spec, loss_fn=None, *,
                   model_file: Optional[Path] = None, reference: bool = True,
                   dump_passes: Optional[Path] = None, owns_model: bool = False) -> Program:
    """Trace, plan, rewrite and emit ``model`` (the same path for the CLI and the API).

    Args:
        model: on cpu (its weights are resharded into the program) or on the meta device
            (program and plan only).
        batch: example inputs, a tuple or dict of tensors (dim 0 batch, dim 1 sequence).
        loss_fn: ``loss_fn(outputs, batch)``, for the reference step; default_loss if None.
        reference: also compute ``reference.safetensors`` (one training step of the model).
        owns_model: the caller's model may be stepped for the reference; otherwise a copy is.

    Raises:
        CaptureError, PlanError: the model cannot be captured or the spec cannot apply.
    """
    pipe = spec.pipeline
    virtual = virtual_stages_of(pipe)
    pp_warnings = check_microbatches(spec.mesh.pp, pipe.microbatches, pipe.schedule, virtual)
    weights = not any(t.is_meta for t in model.parameters())
    if weights and reference:
        _check_batch(batch, spec)
    model.train()
    if not weights:
        batch = _to_meta(batch)
    name = model_file or Path("<in-memory model>")
    captured = capture(model, batch, name)
    gm, mesh = captured.gm, spec.mesh
    groups = tied_groups(model)

    if mesh.pp > 1:
        check_outputs_have_batch_dim(gm, captured.input_names)
    passes = PassManager(dump_passes)
    # a pure rewrite of the captured graph (SDPA's is_causal / enable_gqa for the mask and the
    # repeated kv heads export materialised): every planner below sees attention as eager runs it
    passes.run("eager_attention", apply_eager_attention, gm)
    # facts and plan first, from the captured graph (global shapes); then the passes
    tp_decision = plan_tp(gm.graph, mesh.tp, spec.tensor_parallel.allow_replicated)  # raises early
    plan_vocab(gm.graph, mesh.tp, spec.tensor_parallel.vocab_parallel,
               {n: g[0] for g in groups for n in g}, tp_decision)
    tp_notes = [tp_summary(tp_decision, model), vocab_summary(tp_decision)] if mesh.tp > 1 else []
    dropout = plan_dropout(gm.graph, tp_decision.placements)
    passes.run("cleanup", apply_cleanup, gm)
    blocks = find_blocks(model)
    canonical = {n: g[0] for g in groups for n in g}
    partition = GraphPartition.of(gm.graph, blocks)  # one partition of the captured graph
    costs = collect_costs(gm, blocks, canonical, partition)  # FLOPs of whole stages (all tp ranks)
    num_stages = _num_stages(spec, blocks, costs.block_parts())
    stages_key = "mesh.pp" if pipe.virtual_stages == 1 else "mesh.pp x pipeline.virtual_stages"
    pp_decision = plan_from_costs(costs, num_stages, blocks, pipe, stages_key=stages_key)
    structure = pipeline_structure(gm.graph, model, blocks, costs, canonical, partition)
    plan = build_plan(spec, captured, gm, model, groups, tp_decision, pp_decision, structure)
    plan = dataclasses.replace(plan, imports=modules_needed(gm.graph, captured.out_spec, MODEL_MODULE),
                               scalar_outputs=scalar_outputs(gm),
                               vocab_outputs=tuple(sorted(tp_decision.vocab_outputs.items())),
                               dropout=tuple(dataclasses.asdict(d) for d in dropout))
    pipeline = summarize(pp_decision, costs, pipe.schedule, mesh.pp, pipe.microbatches, virtual)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pp_warnings += check_placement(pipeline, [st.fqns for st in plan.stages], params, canonical)

    passes.run("tensor_parallel", apply_tensor_parallel, gm, tp_decision)
    passes.run("vocab_parallel", apply_vocab_parallel, gm, tp_decision)
    passes.run("untie", apply_untie, gm, groups)
    passes.run("rng_streams", apply_rng_streams, gm, dropout)  # after costs: they see the ATen ops
    # on the tp-rewritten graph (it finds the f and g operators); raises for "true"
    sp_decision = plan_sequence_parallel(gm.graph, mesh.tp, spec.tensor_parallel.sequence_parallel_mode,
                                         tp_decision.placements, dropout, _example_seq(batch))
    passes.run("sequence_parallel", apply_sequence_parallel, gm, sp_decision)
    stages = passes.run_split("split_stages", split_stages, gm, pp_decision, num_stages)
    block_graphs, block_notes = [], []
    for st in stages:
        found, notes = split_blocks(st.graph, blocks)
        block_graphs.append(found)
        block_notes += notes
    plan = check_split(plan, stages, block_graphs, canonical)
    sources = stage_sources(plan, stages, block_graphs, model, name)
    ref = state = None
    if weights:
        state = {fqn: attrgetter(fqn)(gm).detach().clone() for fqn in plan.tensors}
        if reference:
            stepped = model if owns_model else copy.deepcopy(model)
            ref = compute_reference(stepped, batch, loss_fn or default_loss,
                                    captured.input_names, spec)
    warnings = list(tp_decision.warnings) + pp_warnings
    tp_lines = tp_notes + tp_decision.warnings + tp_decision.report + sp_decision.report
    report = render_report(plan, captured.route, tp_lines, pipeline,
                           block_notes + describe_dropout(dropout), pp_warnings)
    return Program(plan, sources, report, model_file, spec.to_dict(), state, ref,
                   warnings=warnings, pipeline=pipeline, notes=tp_notes)


def _num_stages(spec: Spec, blocks: tuple[str, ...], parts=()) -> int:
    """``mesh.pp * pipeline.virtual_stages``: each pp rank runs ``virtual_stages`` stages.

    Raises:
        PlanError: more stages than blocks and the cuts inside them the cost model offers
            (``PipelineCosts.block_parts``; each stage needs one part of a block at least).
    """
    pp, v = spec.mesh.pp, spec.pipeline.virtual_stages
    inside = sum(ok for runs in parts for _, _, ok in runs[1:])
    if v > 1 and pp * v > len(blocks) + inside:
        cuts = f" and {inside} cut(s) inside blocks" if inside else ""
        raise PlanError(f"mesh.pp ({pp}) x pipeline.virtual_stages ({v}) = {pp * v} stages "
                        f"exceeds the number of blocks ({len(blocks)}){cuts} found in the model; "
                        f"use mesh.pp x pipeline.virtual_stages <= {max(len(blocks) + inside, 1)}")
    return pp * v


def _check_batch(batch, spec: Spec) -> None:
    """The example batch feeds --verify (the reference): it must split over dp ranks and
    microbatches. Without weights there is no reference, and training batches may differ.

    Raises:
        PlanError: names mesh.dp, pipeline.microbatches and the batch size.
    """
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    m = spec.pipeline.microbatches if spec.mesh.pp > 1 else 1
    need = spec.mesh.dp * m
    if first.shape[0] % need:
        raise PlanError(f"the example batch size ({first.shape[0]}) is not divisible by mesh.dp "
                        f"({spec.mesh.dp}) x pipeline.microbatches ({m}) = {need}; change "
                        f"example_inputs() or those keys so it divides")




def _example_seq(batch):
    """Dim 1 (the sequence) of the example batch's first input, if it has one."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() >= 2 else None


def _to_meta(batch):
    if isinstance(batch, dict):
        return {k: v.to("meta") for k, v in batch.items()}
    return tuple(v.to("meta") for v in batch)


def _load_checkpoint(model: torch.nn.Module, path: str) -> None:
    try:
        ckpt = load_hf_state_dict(path)
    except CheckpointError as e:
        # a relative checkpoint.path was resolved against the spec file's folder: say so
        hint = ("" if Path(path).exists() else " (a relative checkpoint.path is relative to the "
                "spec file's folder; given as an override, to the current directory)")
        raise CheckpointError(f"checkpoint.path: {e}{hint}") from e
    sd = model.state_dict()
    aliases = {a: g[0] for g in tied_groups(model) for a in g[1:]}
    matched = match_to_model(ckpt, list(sd), aliases, shapes={k: v.shape for k, v in sd.items()})
    try:
        model.load_state_dict({k: v.to(sd[k].dtype) for k, v in matched.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit the model from build_model(): {e}") from e
