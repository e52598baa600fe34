"""What the spec can be checked against before the graph is planned: the microbatches against
the schedule, the example batch against the dp x microbatch split, and the number of stages
against the blocks found."""
from __future__ import annotations

from ..errors import PlanError
from ..frontend.spec import Spec
from .pipeline import repeated_blocks_note
from .pipeline_summary import check_microbatches, virtual_stages_of


def check_spec(spec: Spec, batch, with_reference: bool) -> list[str]:
    """What the spec alone can be checked for before capture: the microbatches (warnings
    returned), and the example batch when it feeds the reference (:func:`check_batch`).

    Raises:
        PlanError: pipeline.microbatches < mesh.pp, or the batch does not split.
    """
    pipe = spec.pipeline
    warnings = check_microbatches(spec.mesh.pp, pipe.microbatches, pipe.schedule,
                                  virtual_stages_of(pipe))
    if with_reference:
        check_batch(batch, spec)
    return warnings


def num_stages_of(spec: Spec, blocks: tuple[str, ...], parts=(), calls=()) -> int:
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
                        f"use mesh.pp x pipeline.virtual_stages <= {max(len(blocks) + inside, 1)}"
                        f"{repeated_blocks_note(blocks, calls)}")
    return pp * v


def check_batch(batch, spec: Spec) -> None:
    """The example batch feeds --verify (the reference): it must split over dp ranks and
    microbatches, every input along dim 0 (an input without the batch dim is kept whole only
    where nothing splits). Without weights there is no reference, and training batches may
    differ.

    Raises:
        PlanError: names mesh.dp, pipeline.microbatches and the batch size, or the input
            whose dim 0 is not the batch.
    """
    items = list(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))
    first = items[0][1]
    m = spec.pipeline.microbatches  # at pp = 1 too: the step accumulates them (batching.py)
    need = spec.mesh.dp * m
    if first.shape[0] % need:
        raise PlanError(f"the example batch size ({first.shape[0]}) is not divisible by mesh.dp "
                        f"({spec.mesh.dp}) x pipeline.microbatches ({m}) = {need}; change "
                        f"example_inputs() or those keys so it divides")
    other = next(((k, t) for k, t in items if t.shape[0] != first.shape[0]), None)
    if need > 1 and other is not None:
        key, t = other
        name = f"key {key!r}" if isinstance(batch, dict) else f"item {key}"
        first_name = f"key {items[0][0]!r}" if isinstance(batch, dict) else "item 0"
        raise PlanError(
            f"example_inputs()'s {name} {tuple(t.shape)} has {t.shape[0]} at dim 0 where "
            f"{first_name} has the batch ({first.shape[0]}): mesh.dp ({spec.mesh.dp}) x "
            f"pipeline.microbatches ({m}) = {need} splits every input along dim 0, and an "
            f"input without the batch dim (per-position ids, a (1, S) table) cannot be split. "
            f"Give it the batch dim (t.expand({first.shape[0]}, *t.shape) in example_inputs() "
            f"where the model accepts it batched), compute it inside forward, or use mesh.dp=1 "
            f"and pipeline.microbatches=1")
