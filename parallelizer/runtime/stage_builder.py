"""Build this rank's stage modules: import the emitted source, load each stage's checkpoint
shard, wrap it for data parallelism by ZeRO stage (runtime/data_parallel.py).

A pp rank runs ``pipeline.virtual_stages`` stages (the plan's ``StagePlan.rank``), so this
rank's part of the model is a :class:`LocalStages`: the stage modules in pipeline order, each
with the original FQNs of the tensors it holds."""
from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from torch.distributed.tensor import distribute_tensor

from ..checkpoint.reader import load_shard
from ..errors import CheckpointError
from ..plan.parallel_plan import ParallelPlan
from .data_parallel import apply_data_parallel
from . import recompute, rng
from .modules import EmittedModule
from .setup import RankContext


def import_stage_class(out_dir: Path, index: int) -> type:
    path = Path(out_dir) / "program" / f"stage{index}.py"
    return stage_class_from_source(path.read_text(), index, str(path))


def stage_class_from_source(source: str, index: int, filename: str | None = None) -> type:
    """The ``Stage{index}`` class defined by emitted ``source`` (a file or in memory)."""
    name = f"parallelizer_program_stage{index}"
    module = types.ModuleType(name)
    module.__file__ = filename or f"<parallelizer stage {index}>"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return getattr(module, f"Stage{index}")


class LocalStages:
    """The pipeline stages one rank runs (one unless ``pipeline.virtual_stages`` > 1).

    Attributes:
        indices: stage indices in pipeline order (``[r, r + pp, ...]`` under loop placement,
            ``[r, 2 pp - 1 - r]`` under V placement).
        modules: the emitted stage modules, same order.

    ``parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()`` and
    ``emitted_blocks()`` run over all of them; names are the original FQNs (a tied weight
    held by two local stages appears once per stage, as two Parameters).
    """

    def __init__(self, indices: list[int], modules: list[torch.nn.Module]):
        assert len(indices) == len(modules) and indices, (indices, modules)
        self.indices, self.modules = list(indices), list(modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __iter__(self):
        return iter(zip(self.indices, self.modules))

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def named_buffers(self):
        for m in self.modules:
            yield from m.named_buffers()

    def buffers(self):
        for m in self.modules:
            yield from m.buffers()

    def emitted_blocks(self) -> list[tuple[str, torch.nn.Module]]:
        return [b for m in self.modules for b in m.emitted_blocks()]


def build_stages(out_dir: Path, plan: ParallelPlan, ctx: RankContext,
                 checkpoint: Path | None = None) -> LocalStages:
    """The stage modules of ``ctx.pp_rank``, each with its (stage, tp) shard of
    ``checkpoint`` (default ``OUT/checkpoint``) loaded, wrapped for data parallelism when dp > 1.

    Raises:
        CheckpointError: the shard is missing, corrupt, for another plan, or lacks a tensor.
    """
    ckpt = Path(checkpoint) if checkpoint else Path(out_dir) / "checkpoint"
    if not ckpt.exists():
        raise CheckpointError(f"no checkpoint at {ckpt}" + ("" if checkpoint else
                              "; compile without --no-weights or pass --load DIR"))
    indices = plan.local_stages(ctx.pp_rank)
    modules = [instantiate(import_stage_class(out_dir, s), plan, ctx,
                           load_shard(ckpt, s, ctx.tp_rank, plan), str(ckpt), s) for s in indices]
    return LocalStages(indices, modules)


def instantiate(cls: type, plan: ParallelPlan, ctx: RankContext, shard: dict,
                source: str = "the checkpoint", index: int | None = None) -> EmittedModule:
    """Create stage ``index`` on this rank's device, fill it from ``shard`` (canonical fqn ->
    local piece), then wrap it for data parallelism (DDP or FSDP2 by ZeRO stage)."""
    stage = cls(ctx.device)
    load_into(stage, plan, shard, ctx, source, index)
    apply_activation_checkpointing(stage, plan)
    apply_compile(stage, plan)
    apply_data_parallel(stage, ctx, plan)
    return stage


def apply_compile(stage: EmittedModule, plan: ParallelPlan) -> None:
    """Spec ``compile: true``: ``torch.compile`` each emitted block in place
    (``nn.Module.compile``: parameter names unchanged), after activation checkpointing and
    before FSDP2 / DDP, as torchtitan compiles each transformer block. The code between
    blocks (embedding, final norm, head) stays eager; dynamo splits a block's graph where it
    meets an operator it cannot trace (the tp collectives run eagerly there)."""
    if not plan.settings.get("compile"):
        return
    for _name, block in stage.emitted_blocks():
        block.compile()


@torch.no_grad()
def load_into(stage: torch.nn.Module, plan: ParallelPlan, shard: dict, ctx: RankContext,
              source: str = "the checkpoint", index: int | None = None) -> None:
    """Copy ``shard`` into the stage's tensors, FSDP2-sharded (DTensor) ones included.

    Raises:
        CheckpointError: a tensor is missing or has another shape.
    """
    where = f"stage {ctx.pp_rank if index is None else index}, tp {ctx.tp_rank}"
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        fqn = plan.aliases.get(name, name)
        if fqn not in shard:
            raise CheckpointError(f"{source} ({where}) lacks {fqn}")
        src = shard[fqn]
        experts = plan.tensors[fqn].experts if fqn in plan.tensors else None
        if experts is not None:  # the file holds every expert: take this ep rank's rows
            lo, hi = experts.rows(src.shape[experts.dim], ctx.ep_rank)
            src = src.narrow(experts.dim, lo, hi - lo)
        src = src.to(ctx.device)
        if hasattr(t, "device_mesh"):  # an FSDP2 shard: take this rank's chunk of src
            src = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None).to_local()
            t = t.to_local()
        if tuple(src.shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: {fqn} has shape {tuple(src.shape)}, the program "
                                  f"expects {tuple(t.shape)} on ({where})")
        t.copy_(src)


def apply_activation_checkpointing(stage: EmittedModule, plan: ParallelPlan) -> None:
    """Recompute checkpointed blocks in backward instead of saving their activations
    (Chen et al. 2016; ``torch.utils.checkpoint``, non-reentrant). The block's forward is
    wrapped in place, so FQNs stay the original ones and FSDP2 hooks still fire. The
    recompute draws the dropout masks the forward drew and leaves the forward's buffer
    writes undone (:func:`checkpoint_contexts`)."""
    for name, block in stage.emitted_blocks():
        if name in plan.checkpointed:  # decided by the planner (planning/tensors.py)
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                              context_fn=checkpoint_contexts)


def checkpoint_contexts():
    """``context_fn`` of the checkpointed blocks: the forward's RNG streams restored in the
    recompute (``rng.checkpoint_contexts``), which runs with ``recompute.recomputing()``
    true, so the forward's buffer writes are not done again (``runtime/recompute.py``)."""
    forward, again = rng.checkpoint_contexts()
    return forward, recompute.Recomputing(again)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameter or gradient), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t
