"""Build this rank's stage module: import the emitted source, load its checkpoint shard,
shard it with FSDP2 over the dp mesh dim (ZeRO-3: ``fully_shard`` per block, then the stage)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

from ..checkpoint.reader import load_shard
from ..errors import CheckpointError
from ..plan import ParallelPlan
from .modules import EmittedModule
from .setup import RankContext


def import_stage_class(out_dir: Path, index: int) -> type:
    path = Path(out_dir) / "program" / f"stage{index}.py"
    name = f"parallelizer_program_stage{index}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, f"Stage{index}")


def build_stage(out_dir: Path, plan: ParallelPlan, ctx: RankContext,
                checkpoint: Path | None = None) -> EmittedModule:
    """The stage module of ``ctx.pp_rank`` with the (pp, tp) shard of ``checkpoint``
    (default ``OUT/checkpoint``) loaded, FSDP2-sharded when dp > 1.

    Raises:
        CheckpointError: the shard is missing, corrupt, for another plan, or lacks a tensor.
    """
    stage = import_stage_class(out_dir, ctx.pp_rank)(ctx.device)
    ckpt = Path(checkpoint) if checkpoint else Path(out_dir) / "checkpoint"
    if not ckpt.exists():
        raise CheckpointError(f"no checkpoint at {ckpt}; compile without --no-weights or pass --load DIR")
    shard = load_shard(ckpt, ctx.pp_rank, ctx.tp_rank, plan)
    state = {}
    for name in stage.state_dict():
        fqn = plan.aliases.get(name, name)
        if fqn not in shard:
            raise CheckpointError(f"{ckpt} (pp {ctx.pp_rank}, tp {ctx.tp_rank}) lacks {fqn}")
        state[name] = shard[fqn]
    stage.load_state_dict(state, strict=True)
    if plan.mesh["dp"] > 1:
        apply_fsdp(stage, ctx)
    return stage


def apply_fsdp(stage: EmittedModule, ctx: RankContext) -> None:
    """FSDP2 per block (the units that all-gather just before use and free after), then the
    stage root for what lies outside blocks (embeddings, final norm, head)."""
    dp_mesh = ctx.mesh["dp"]
    for _name, block in stage.emitted_blocks():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameter or gradient), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t
