"""The compiler: model.py + spec -> Program (emitted source, plan, resharded weights).

:func:`compile_module` is its steps, in order:

- :func:`analyse`: capture the model and rewrite attention as eager runs it (the front end
  the layout advisor shares, with :func:`measure`: the per-unit costs; ``analyse.py``);
- :func:`plan`: every planner on the captured graph, each returning its own decision, and
  the spec with those decisions turned into the ParallelPlan once;
- :func:`apply_passes`: the rewrites the plan asks for, then sequence parallelism, planned
  on the graph those rewrites produced, and the split into stages;
- :func:`check_stages`: every parameter's gradient checked against the plan's gradient
  syncs, each stage's blocks, and the split checked against the plan;
- :func:`check_program`: the program sources, each stage executed for one tp rank on
  FakeTensors, forward and backward, before anything is written;
- :func:`self_check`: (small models, or ``--self-check``) every tp rank of the program on
  real fp32 tensors in one process, compared with the unmodified model;
- :func:`emit`: weights, reference step and report.

Planners read facts and return data; passes read a plan and rewrite the graph (docs/architecture.md).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path
from typing import Optional

import torch

from .analyse import Analysis, analyse, measure
from .emit.stages import stage_sources
from .checkpoint.hf import load_hf_state_dict, match_to_model
from .errors import CaptureError, CheckpointError, PlanError
from .frontend.model_file import check_module_tree, default_loss, load_model, user_frame
from .frontend.capture_hints import exact_type_sites
from .frontend.regions import check_autocast_off
from .analysis.graph_facts import read_attrs
from .analysis.gradient_accounting import check_gradients
from .analysis.parameter_writes import written_buffer_warnings
from .analysis.outputs import fixed_size_warnings, fixed_sizes
from .passes.aliases import apply_untie
from .passes.dropout import apply_rng_streams
from .passes.expert_parallel import apply_expert_parallel
from .passes.manager import PassManager
from .passes.split_blocks import split_blocks
from .passes.split_check import (check_split, check_stage_writes, check_written_buffers,
                                 shared_weights)
from .passes.split_stages import split_stages
from .passes.sequence_parallel import apply_sequence_parallel
from .passes.tensor_parallel import apply_tensor_parallel
from .passes.token_mean import apply_token_mean
from .passes.vocab_parallel import apply_vocab_parallel
from .passes.vmap_levels import apply_vmap_levels
from .analysis.expert_ffn import expert_ffn
from .analysis.experts import find_expert_layers
from .plan.decisions import (EPDecision, PipelineDecision, SequenceParallelDecision,
                             TokenMeanDecision, TPDecision, VocabDecision)
from .plan.parallel_plan import ParallelPlan
from .planning.dropout import (describe as describe_dropout, describe_random, plan_dropout,
                               plan_random_ops)
from .planning.experts import ep_summary, plan_ep
from .planning.pipeline import plan_from_costs
from .planning.pipeline_summary import (check_placement, repeated_calls_warning, summarize,
                                        virtual_stages_of)
from .planning.spec_checks import check_spec, num_stages_of
from .planning.tensors import alias_map, build_plan, pipeline_structure, tied_groups
from .planning.sequence import plan_sequence_parallel, sequence_note
from .planning.token_mean import plan_token_mean, token_mean_note
from .runtime.token_mean import counter
from .passes.fill_precision import apply_fill_precision
from .passes.norm_precision import apply_norm_precision
from .passes.recompute_writes import apply_recompute_writes
from .planning.tp import check_sharded, plan_tp
from .planning.tp_matrices import tp_kept_note, tp_summary
from .planning.vocab import plan_vocab, vocab_summary
from .emit.program import Program, check_replaceable
from .emit.rank_check import check_ranks, share_rows
from .emit.numerics_check import When as SelfCheckWhen, check_numerics, model_reference
from .emit.numerics_check import when as self_check_when
from .emit.reference import (batch_rows, check_gradients_held, compute_reference, copy_model,
                             nonfinite_warnings, sample_mean_warnings, stack_reference)
from .emit.report import render_report, stage_sends
from .frontend.branches import check_example_chunks, decided_warnings
from .frontend.spec import Spec


def compile_to_dir(model_path: Path, spec: Spec, out_dir: Path, weights: bool = True,
                   dump_passes: Optional[Path] = None, topology=None) -> None:
    """CLI entry: compile and write OUT/ atomically (nothing is written on error);
    the compiler's warnings go to stderr. ``topology`` (:class:`parallelizer.emit.launch.Topology`,
    default one node) gives OUT/launch.sh, OUT/launch.sbatch and report.md's placement table."""
    from .emit.launch import launch_files, one_node, placement_lines
    check_replaceable(Path(out_dir))  # before the compile: a refusal costs no minute
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
    loaded = load_model(model_path, on_meta=not weights)
    if weights and spec.checkpoint.path:
        _load_checkpoint(loaded.model, spec.checkpoint.path)
    return compile_module(loaded.model, loaded.batch, spec, loaded.loss_fn,
                          model_file=Path(model_path), dump_passes=dump_passes, owns_model=True)


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
    check_module_tree(model, model_file)
    weights = not any(t.is_meta for t in model.parameters())
    pp_warnings = check_spec(spec, batch, weights and reference)
    if not weights:
        batch = _to_meta(batch)
    passes = PassManager(dump_passes)
    analysis = analyse(model, batch, model_file or Path("<in-memory model>"), passes,
                       pp=spec.mesh.pp, ep=spec.mesh.ep,
                       microbatches=spec.pipeline.microbatches, dp=spec.mesh.dp, tp=spec.mesh.tp,
                       branches=spec.capture.data_dependent_branches)
    check_autocast_off(analysis.captured.gm, spec.mixed_precision.param_dtype)
    pp_warnings += fixed_size_warnings(fixed_sizes(analysis.captured.gm,
                                                   analysis.captured.input_names),
                                       analysis.captured.gm)
    pp_warnings += decided_warnings(analysis.captured.gm)
    if weights:
        check_example_chunks(analysis.captured.gm, analysis.captured.input_names, batch,
                             spec.mesh.dp * (spec.pipeline.microbatches if spec.mesh.pp > 1
                                             else 1))
    pp_warnings += written_buffer_warnings(analysis.captured.gm, spec.pipeline.microbatches)
    pp_warnings += list(analysis.warnings)
    planned = plan(analysis, spec, passes)
    stages, sequence = apply_passes(analysis, planned, spec, batch, passes)
    checked = check_stages(analysis, planned, stages, sequence)
    sources = check_program(analysis, checked, batch)
    decision, checked_note = self_check(analysis, checked, spec, batch, sources, weights)
    if not decision.run:
        pp_warnings += exact_type_warnings(analysis.model, decision.skipped)
    program = emit(analysis, planned, checked, sequence, spec, batch, loss_fn, sources,
                   model_file=model_file, weights=weights, reference=reference,
                   owns_model=owns_model, pp_warnings=pp_warnings + planned.warnings)
    program.notes = program.notes + checked_note  # printed, not in report.md (it has seconds)
    return program


@dataclass
class Planned:
    """Every planner's decision (:func:`plan`) and the ParallelPlan built from them."""
    plan: ParallelPlan
    tp: TPDecision
    vocab: VocabDecision
    dropout: tuple
    pipeline: PipelineDecision
    summary: dict                 # planning/pipeline_summary.summarize
    notes: list                   # the compile's one-line summaries (printed by the CLI)
    warnings: list                # check_placement's (report.md, stderr)
    ep: EPDecision = None
    random: tuple = ()            # planning/dropout.plan_random_ops: RandomSite each
    token: TokenMeanDecision = TokenMeanDecision()


def plan(analysis: Analysis, spec: Spec, passes: PassManager) -> Planned:
    """Tensor parallelism, vocab_parallel and the dropout streams on the graph as captured,
    then :func:`measure` and the pipeline stages on its costs, then the plan.

    The sharding planners read the graph as export gives it, the cost model the graph the
    cleanup pass leaves, so cleanup runs between them: export's metadata checks are readers
    of a table to the vocab planner and its device constants are arguments DTensor's
    strategies see, so moving a planner across cleanup could change its decision.

    Raises:
        PlanError: the spec cannot apply (names the spec key and the fix).
    """
    mesh, pipe, graph = spec.mesh, spec.pipeline, analysis.gm.graph
    ep = _plan_experts(graph, mesh, analysis.module_experts)  # raises early, naming the module
    allow_replicated = spec.tensor_parallel.allow_replicated
    tp = plan_tp(graph, mesh.tp, allow_replicated, expert_dims=ep.dims,  # raises early
                 vocab_next=True)
    vocab = plan_vocab(graph, mesh.tp, spec.tensor_parallel.vocab_parallel, analysis.canonical, tp)
    check_sharded(tp, vocab, allow_replicated)  # raises: tp > 1 shards no weight at all
    counted = (tp, analysis.model, vocab, analysis.blocks, ep.dims, analysis.stacked,
               read_attrs(graph))
    notes = [tp_summary(*counted), tp_kept_note(*counted),
             vocab_summary(vocab)] if mesh.tp > 1 else []
    notes = [n for n in notes if n]
    if ep_summary(ep):
        notes.append(ep_summary(ep))
    random = plan_random_ops(graph, tp.placements, mesh.tp)  # raises: one tp cannot draw alike
    dropout = plan_dropout(graph, tp.placements, tp.redistributions)
    token = plan_token_mean(graph, analysis.captured.input_names)  # copies nodes cleanup changes
    notes += [token_mean_note(token)] if token.sites else []
    measured = measure(analysis, passes)
    costs, blocks = measured.costs, analysis.blocks
    num_stages = num_stages_of(spec, blocks, costs.block_parts(), costs.block_calls)
    stages_key = "mesh.pp" if pipe.virtual_stages == 1 else "mesh.pp x pipeline.virtual_stages"
    pipeline = plan_from_costs(costs, num_stages, blocks, pipe, stages_key=stages_key)
    structure = pipeline_structure(graph, analysis.model, blocks, costs, analysis.canonical,
                                   measured.partition)
    if analysis.stacked:  # parallelize export writes the experts' own names back
        structure["stacked"] = {k: list(v) for k, v in analysis.stacked.items()}
    built = build_plan(spec, analysis.captured, analysis.gm, analysis.model, analysis.groups, tp,
                       vocab, dropout, pipeline, structure, ep, random)
    if token.sites:
        built = replace(built, token_means={"sites": list(token.sites), "counter": token.counter,
                                            "exact": token.exact})
    summary = summarize(pipeline, costs, pipe.schedule, mesh.pp, pipe.microbatches,
                        virtual_stages_of(pipe))
    stacked = {m for members in analysis.stacked.values() for m in members}
    params = {n for n, _ in analysis.model.named_parameters(remove_duplicate=False)
              if n not in stacked} | set(analysis.stacked)
    warnings = check_placement(summary, [st.fqns for st in built.stages], params,
                               analysis.canonical)
    warnings += repeated_calls_warning(summary, blocks, costs.block_calls)
    return Planned(built, tp, vocab, dropout, pipeline, summary, notes, warnings, ep, random, token)


def _plan_experts(graph, mesh, unstacked: tuple = ()) -> EPDecision:
    """Expert parallelism over ``mesh.ep`` and, at ``mesh.tp`` > 1, the experts' FFN dim over
    tp (planning/experts.py); ``unstacked``: expert lists the stack_experts pass refused."""
    layers, unsupported = find_expert_layers(graph)
    unsupported = list(unsupported) + list(unstacked)
    ffn = [expert_ffn(graph, layer) for layer in layers] if mesh.tp > 1 else None
    return plan_ep(layers, unsupported, mesh.ep, mesh.tp, ffn)


def apply_passes(analysis: Analysis, planned: Planned, spec: Spec, batch,
                 passes: PassManager) -> tuple[list, SequenceParallelDecision]:
    """The rewrites of the plan's decisions, in place, then the split into stage graphs.

    Sequence parallelism is planned here, on the rewritten graph, not in :func:`plan`: its
    regions grow from the Megatron f and g operators the tensor_parallel and vocab_parallel
    passes insert, and its decision names those nodes and the untied and rng_streams
    nodes, which do not exist before the passes run.

    Raises:
        PlanError: ``tensor_parallel.sequence_parallel`` is "true" and cannot apply.
    """
    gm = analysis.gm
    passes.run("token_mean", apply_token_mean, gm, planned.token)
    passes.run("expert_parallel", apply_expert_parallel, gm, planned.ep)
    passes.run("tensor_parallel", apply_tensor_parallel, gm, planned.tp)
    passes.run("vocab_parallel", apply_vocab_parallel, gm, planned.vocab)
    passes.run("untie", apply_untie, gm, analysis.groups)
    # costs saw the ATen ops
    passes.run("rng_streams", apply_rng_streams, gm, planned.dropout + planned.random)
    passes.run("norm_precision", apply_norm_precision, gm, spec.mixed_precision.param_dtype)
    passes.run("fill_precision", apply_fill_precision, gm, spec.mixed_precision.param_dtype)
    passes.run("recompute_writes", apply_recompute_writes, gm, spec.activation_checkpointing.mode)
    # plan on the rewritten graph (see above); raises for "true"
    sequence = plan_sequence_parallel(gm.graph, spec.mesh.tp,
                                      spec.tensor_parallel.sequence_parallel_mode,
                                      planned.tp.placements, planned.dropout, _example_seq(batch),
                                      analysis.blocks)
    passes.run("sequence_parallel", apply_sequence_parallel, gm, sequence)
    passes.run("vmap_levels", apply_vmap_levels, gm)  # after every pass that inserts ops
    stages = passes.run_split("split_stages", split_stages, gm, planned.pipeline,
                              planned.pipeline.num_stages)
    return stages, sequence


@dataclass(frozen=True)
class Checked:
    """The stage graphs, each stage's block graphs, and the plan with what the split graphs
    hold recorded (:func:`check_stages`)."""
    plan: ParallelPlan
    stages: list
    block_graphs: list
    notes: list  # split_blocks' report lines
    sends: dict  # stage index -> what it sends, for report.md (emit/report.py stage_sends)


def check_stages(analysis: Analysis, planned: Planned, stages: list,
                 sequence: SequenceParallelDecision) -> Checked:
    """Check every parameter's gradient on the stage graphs against the plan's gradient
    syncs; split each stage into its blocks; check that the split graphs hold what the plan
    planned, and record their boundary names in it.

    Raises:
        PlanError: a gradient the plan leaves Partial, Mixed or unsummed
            (analysis/gradient_accounting.py), a tensor read by two emitted modules of one
            stage, a buffer the model writes in place held by several blocks, or one
            written in one pipeline stage and read in another (passes/split_check.py):
            naming the tensor.
    """
    check_written_buffers(analysis.gm.graph, analysis.groups, analysis.blocks)
    check_stage_writes(stages)
    check_gradients(planned.plan, stages)  # on the graphs split_blocks is about to outline
    # what each stage sends, read before split_blocks outlines the blocks that produce it
    inputs = [n for n in analysis.gm.graph.nodes if n.op == "placeholder"]
    sends = stage_sends(stages, inputs, sequence.region, sequence.tp)
    block_graphs, notes, whole = [], [], set()
    for st in stages:
        shared = shared_weights(st.graph, analysis.blocks, planned.plan, analysis.canonical)
        if shared:  # one module would hold each weight, not one per block: one unit
            block_graphs.append([])
            notes.append(f"stage {st.index}: {shared}; stage kept as one FSDP unit, without "
                         f"per-block activation checkpointing")
            whole.add(st.index)
            continue
        found, found_notes = split_blocks(st.graph, analysis.blocks)
        block_graphs.append(found)
        notes += found_notes
        if found_notes:  # the blocks' runs interleave: the stage is one unit
            whole.add(st.index)
    checked = check_split(planned.plan, stages, block_graphs, analysis.canonical, whole)
    return Checked(checked, stages, block_graphs, notes, sends)


def check_program(analysis: Analysis, checked: Checked, batch) -> dict:
    """The emitted sources (program/stage{i}.py, run.py), each stage executed for one tp
    rank on FakeTensors, forward and backward (emit/rank_check.py), before anything is
    written.

    Raises:
        PlanError: a stage fails on a rank's shapes (names the op and the model's source
            line), or a parameter's gradient has another shape than planned.
        CaptureError: it fails because the unmodified model fails by itself.
    """
    plan_ = checked.plan
    sources = stage_sources(plan_, checked.stages, checked.block_graphs, analysis.model,
                            analysis.name)
    graphs = [(st.graph, {b.fqn: b.graph for b in blocks})
              for st, blocks in zip(checked.stages, checked.block_graphs)]
    try:
        check_ranks(plan_, sources, batch, graphs)
    except PlanError:
        if not any(p.is_meta for p in analysis.model.parameters()):  # the model's own error?
            model_reference(analysis.model, batch, model_file=analysis.name)
            _model_on_share(analysis, plan_, batch)
        raise
    return sources


def _model_on_share(analysis: Analysis, plan_, batch) -> None:
    """The unmodified model on the samples one stage runs at a time (one microbatch of one
    dp rank, as the rank check ran them), when fewer than the example batch.

    Raises:
        PlanError: the model fails on that share by itself (BatchNorm in training mode over
            a 1x1 map of one sample: LeViT's strided query), naming its error and line, the
            share and the fix.
    """
    rows, size = share_rows(plan_, batch)
    if rows >= size:
        return
    try:
        model_reference(analysis.model, batch_rows(batch, size, 0, rows),
                        model_file=analysis.name)
    except CaptureError as e:
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise PlanError(
            f"the model fails on {rows} sample(s) at a time, the share of the example batch "
            f"of {size} that one stage runs under mesh.dp x pipeline.microbatches = "
            f"{size // rows}, without parallelizer too: {type(cause).__name__}: {first}"
            f"{user_frame(cause, analysis.name)}\nFix: fewer microbatches or dp ranks, or a "
            f"larger example batch in example_inputs()") from e


def self_check(analysis: Analysis, checked: Checked, spec: Spec, batch, sources: dict,
               weights: bool) -> tuple[SelfCheckWhen, list[str]]:
    """The numerics self-check (emit/numerics_check.py) when ``spec.self_check`` asks for it:
    every tp rank of the program run on the example batch in one process, outputs and
    gradients compared with the unmodified model. Returns whether it ran (and why not), and
    the compile's note about it.

    Raises:
        PlanError: a tensor differs (a bug in parallelizer, naming it; or the model's exact-
            type check of a tensor, :func:`exact_type_sites`, named as the likelier cause),
            or ``self_check.mode`` true on a program it cannot check.
    """
    decision = self_check_when(spec.self_check, checked.plan, analysis.model, batch, weights)
    if not decision.run:
        return decision, [decision.note] if decision.note else []
    state = {fqn: attrgetter(fqn)(analysis.gm) for fqn in checked.plan.tensors}
    try:
        return decision, [check_numerics(checked.plan, sources, analysis.model, batch, state,
                                         spec.seed, analysis.name).note()]
    except PlanError as e:
        sites = exact_type_sites(analysis.model)
        if not sites:
            raise
        raise PlanError(f"{e}\nLikelier than a bug: the model checks a tensor's exact type at "
                        f"{'; '.join(sites)}; {_EXACT_TYPE_WHY}") from e


# why an exact-type check of a tensor makes the program another function than the model
_EXACT_TYPE_WHY = ("under capture every tensor is a FakeTensor, so such a check is False where "
                   "the model's own run finds it True, and the program takes the other path "
                   "there. Write isinstance(x, torch.Tensor), which is what such a check means")


def exact_type_warnings(model: torch.nn.Module, skipped: str) -> list[str]:
    """The compile's warning where the self-check did not run (``skipped``: why, if a note
    says) and the model checks a tensor's exact type (:func:`exact_type_sites`)."""
    sites = exact_type_sites(model)
    if not sites:
        return []
    why = f" ({skipped})" if skipped else ""
    return [f"the model checks a tensor's exact type at {'; '.join(sites)}: {_EXACT_TYPE_WHY}. "
            f"The numerics self-check, which compares the program with the model on the "
            f"example batch, did not run{why}; --self-check (self_check.mode=true) runs it"]


def emit(analysis: Analysis, planned: Planned, checked: Checked,
         sequence: SequenceParallelDecision, spec: Spec, batch, loss_fn, sources: dict, *,
         model_file: Optional[Path], weights: bool, reference: bool, owns_model: bool,
         pp_warnings: list) -> Program:
    """The Program: the stage ``sources``, with ``weights`` those of every planned tensor and
    (with ``reference``) the reference step, and report.md."""
    plan_, model, gm = checked.plan, analysis.model, analysis.gm
    ref = state = None
    if weights:
        state = {fqn: attrgetter(fqn)(gm).detach().clone() for fqn in plan_.tensors}
        if reference:
            stepped = model if owns_model else copy_model(model)
            # a loss of whole-step token means: the chunks weighed by their counts (sites
            # weighing them differently: no one weighing fits, no check; reference.py)
            means = plan_.token_means if loss_fn in (None, default_loss) else {}
            whole = means.get("exact", False)
            count = counter(means["counter"]) if whole else None
            ref = stack_reference(compute_reference(stepped, batch, loss_fn or default_loss,
                                                    analysis.captured.input_names, spec, model_file,
                                                    chunks=not whole or count is not None,
                                                    count=count),
                                  analysis.stacked)
            check_gradients_held(ref, plan_)
            pp_warnings = (pp_warnings + nonfinite_warnings(ref)
                           + sample_mean_warnings(ref, spec, model, analysis.captured.gm.graph))
    tp = planned.tp
    tp_lines = planned.notes + tp.warnings + list(plan_.tp_report) + sequence.report + planned.ep.report
    # what each stage sends, as module and per-rank shape (report.md, pipeline.json, inspect)
    summary = {**planned.summary, "stages": [
        {**st, "sends": checked.sends.get(st["index"], [])} for st in planned.summary["stages"]]}
    streams = describe_dropout(planned.dropout) + describe_random(planned.random)
    report = render_report(plan_, analysis.captured.route, tp_lines, summary,
                           checked.notes + streams, pp_warnings, attention=analysis.attention)
    return Program(plan_, sources, report, model_file, spec.to_dict(), state, ref,
                   warnings=list(tp.warnings) + pp_warnings, pipeline=summary,
                   notes=planned.notes + [n for n in [sequence_note(sequence)] if n])


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
    aliases = alias_map(tied_groups(model), include_canonical=False)
    matched = match_to_model(ckpt, list(sd), aliases, shapes={k: v.shape for k, v in sd.items()})
    try:
        model.load_state_dict({k: v.to(sd[k].dtype) for k, v in matched.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit the model from build_model(): {e}") from e
