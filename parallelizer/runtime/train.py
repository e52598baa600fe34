"""Training state of ``run.py --train --save DIR`` / ``--resume DIR`` (the loop is
runtime/loop.py): the trained weights, the AdamW state (``exp_avg``, ``exp_avg_sq``,
``step``, in the parameters' layout), the step counter, the LR schedule, the loss scale and
the data position, in the program's sharded layout. ``--resume`` restores them all, so
training continues as if uninterrupted, on the program's own layout (reshard the checkpoint
to it first). Every rank writes its own shards (runtime/sharded_save.py); nothing is
gathered. A model with dropout restores every rank's dropout streams too
(``runtime/rng.py``), on the same mesh."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from ..checkpoint.reader import load_shard, read_manifest
from ..checkpoint.format import OPTIM_STATES, optim_name
from ..errors import CheckpointError, UserError
from ..plan.parallel_plan import ParallelPlan
from .batching import synthetic_batches
from . import rng
from .gather import full_tensor
from .compression import write_state as write_compression_state
from .setup import RankContext
from .periodic import set_rng_state
from .sharded_save import save_sharded


@dataclass
class TrainState:
    """What a training checkpoint holds beside the weights: the optimizer, the LR schedule
    (runtime/lr_schedule.py), the fp16 loss scale (runtime/loss_scale.py), the batches per
    step and the data position (batches consumed: ``step x grad_accum``)."""
    optimizer: object
    schedule: object = None
    scaler: object = None
    accum: int = 1
    data_position: int = 0
    data_batches: dict | None = None  # a token file's {batch_size, seq_len}: what a position counts

    def manifest_extra(self) -> dict:
        """The manifest's ``train`` entries of this state (JSON data)."""
        out = {"data_position": self.data_position, "grad_accum": self.accum}
        if self.data_batches is not None:
            out["data_batches"] = dict(self.data_batches)
        if self.schedule is not None:
            out["schedule"] = self.schedule.state_dict()
        if self.scaler is not None and self.scaler.state() is not None:
            out["loss_scale"] = self.scaler.state()
        return out


def training_state_error(plan: ParallelPlan) -> str | None:
    """Why this program cannot save or resume optimizer state (None when it can)."""
    if plan.zero_stage == 1 and plan.mesh["dp"] > 1:
        return ("--save/--resume of the optimizer state under zero_stage 1 with dp > 1 "
                "(ZeroRedundancyOptimizer) is not supported yet; use zero_stage 0, 2 or 3")
    return None


def load_optimizer_state(opt, stages, plan: ParallelPlan, ctx: RankContext, ckpt: Path) -> int:
    """Fill ``opt`` (AdamW or SGD) with the state stored in ``ckpt`` for this rank's stages
    (:class:`LocalStages`; one file per (stage, tp): each local stage's parameters, a tied
    weight's copies included, read their own stage's file; FSDP2 shards: this rank's dp
    chunk); returns the step counter to continue from.

    Raises:
        CheckpointError: the checkpoint holds no training state (weights only).
    """
    manifest = read_manifest(ckpt)
    if "train" not in manifest:
        raise CheckpointError(f"{ckpt} holds weights only (no 'train' entry in manifest.json); "
                              "--resume needs a checkpoint written by run.py --train --save; use "
                              "--load to start from weights")
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state = {}
    for stage_index, module in stages:
        shard = load_shard(ckpt, stage_index, ctx.tp_rank, plan, optim=True)
        for name, p in module.named_parameters():
            fqn = plan.aliases.get(name, name)
            if optim_name(fqn, "step") in shard:
                state[index[id(p)]] = _param_state(shard, fqn, p, ctx)
    sd["state"] = state
    opt.load_state_dict(sd)
    step = int(manifest["train"]["step"])
    states = manifest["train"].get("rng") or []
    restored = len(states) == dist.get_world_size() and isinstance(states[ctx.rank], dict) and \
        set_rng_state(states[ctx.rank], ctx.device, plan.mesh)
    if not restored and (plan.dropout or plan.random):
        reseed_dropout(plan, ctx, step)
    return step


def reseed_dropout(plan: ParallelPlan, ctx: RankContext, step: int) -> None:
    """No saved dropout-stream state for this rank (a checkpoint resharded to another mesh):
    reseed the streams from the seed and ``step`` (fresh masks, not those of steps 1..step);
    rank 0 says so."""
    rng.seed_streams(plan.seed, ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, plan.mesh["tp"], step)
    if ctx.rank == 0:
        m = plan.mesh
        print(f"note: the checkpoint holds no dropout RNG state for this mesh (pp={m['pp']} x "
              f"dp={m['dp']} x tp={m['tp']}): dropout streams reseeded from seed {plan.seed} "
              f"and step {step}", flush=True)


def _param_state(shard: dict, fqn: str, p, ctx: RankContext) -> dict:
    st = {}
    for key in OPTIM_STATES:
        v = shard[optim_name(fqn, key)]
        if key != "step":
            v = v.to(ctx.device)
            if hasattr(p, "device_mesh"):  # FSDP2: this rank's dp chunk, as a DTensor
                v = distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
        st[key] = v
    return st


def batch_source(plan: ParallelPlan, model_module, spec: dict):
    """model.py's batches(), else seeded synthetic batches shaped like example_inputs()."""
    if model_module is not None and hasattr(model_module, "batches"):
        return model_module.batches()
    if model_module is not None:
        return synthetic_batches(plan, model_module.example_inputs(), plan.seed)
    raise ValueError("--train needs batches: this program has no model.py (compiled from an "
                     "in-memory model); train it through the Python API instead")


def gather_full_state(stage, plan: ParallelPlan, ctx: RankContext) -> dict | None:
    """Every tensor of the model at full shape under its canonical FQN, on global rank 0
    (None elsewhere). Collective over all ranks. An explicit gather for small models (the
    API's ``full_state_dict``): rank 0 holds the whole model, sent through a pickled
    ``gather_object``; checkpoints never take this path (:func:`save_checkpoint`)."""
    tp = plan.mesh["tp"]
    mine = {}
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        fqn = plan.aliases.get(name, name)
        full = full_tensor(t, plan.tensors[fqn], ctx, tp).cpu()
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            mine[fqn] = full
    return _merge_on_rank0(mine, ctx)


def _merge_on_rank0(mine: dict, ctx: RankContext) -> dict | None:
    """Every rank's ``mine`` merged into one dict on global rank 0 (None elsewhere). Collective."""
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if ctx.rank != 0:
        return None
    out = {}
    for part in gathered:
        out.update(part)
    return out


def check_save_target(out: Path, plan: ParallelPlan | None = None) -> None:
    """A save may replace an earlier checkpoint of the same model (a folder with
    manifest.json whose tensors are ``plan``'s), never other files, another model's
    checkpoint, a compiled program, or the weights a program was compiled with.

    Raises:
        UserError: ``out`` is a file, a program folder (plan.json), an OUT/checkpoint, a
            non-empty folder that is not a checkpoint, or a checkpoint of other tensors.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"--save {out}: a file is in the way; pass a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if (out / "plan.json").exists() or (out.parent / "plan.json").exists():
        raise UserError(f"--save {out}: that is a compiled program or its checkpoint/, which "
                        f"--verify needs; save somewhere else")
    if not (out / "manifest.json").exists():
        raise UserError(f"--save {out}: the folder holds files that are not a parallelizer "
                        f"checkpoint; save into a new or empty folder")
    if plan is not None:
        _check_same_model(out, plan)


def _check_same_model(out: Path, plan: ParallelPlan) -> None:
    """The checkpoint in ``out`` holds the tensors of ``plan``'s model (any layout)."""
    import json
    from ..checkpoint.format import OPTIM_PREFIX
    try:
        names = json.loads((out / "manifest.json").read_text())["tensors"]
    except (OSError, ValueError, KeyError, TypeError):
        names = None  # unreadable: not knowably this model's
    theirs = {n for n in names or () if not n.startswith(OPTIM_PREFIX)}
    if names is not None and theirs == set(plan.tensors):
        return
    extra, missing = sorted(theirs - set(plan.tensors)), sorted(set(plan.tensors) - theirs)
    seen = (f"it holds {', '.join(extra[:2])}{' ...' if len(extra) > 2 else ''} and lacks "
            f"{', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''}" if names is not None
            else "its manifest.json cannot be read")
    raise UserError(f"--save {out}: that folder is a checkpoint of another model ({seen}); a "
                    f"save replaces only a checkpoint of this program's model: save into a new "
                    f"or empty folder")


def save_checkpoint(stage, plan: ParallelPlan, ctx: RankContext, out: Path, opt=None,
                    step: int | None = None, optimizer: str = "", profile: bool = False) -> None:
    """Write the model (and, with ``opt``, its optimizer state, the step counter = data
    position and each rank's RNG state) to ``out`` in the plan's sharded layout: every rank
    writes its own shards, no gather (:mod:`parallelizer.runtime.sharded_save`), published
    atomically. Collective. ``profile``: print a ``SAVE_MEMORY`` line per rank."""
    check_save_target(Path(out), plan)  # on every rank, before any collective: all raise alike
    train = ({"step": step, "optimizer": optimizer, "data_position": step}
             if opt is not None else None)
    if isinstance(opt, TrainState):  # the loop's state: schedule, loss scale, data position
        train.update(opt.manifest_extra())
        opt = opt.optimizer
    if profile:
        from .memory import print_save_memory, start_save_measure
        before = start_save_measure(ctx)
    extra = None
    if opt is not None and ctx.compression is not None:  # per rank: error feedback differs
        extra = functools.partial(write_compression_state, ctx.compression, plan, rank=ctx.rank)
    written = save_sharded(stage, plan, ctx, Path(out), opt, train, extra)
    if profile:
        largest = max(math.prod(t.shape) * getattr(torch, t.dtype).itemsize for t in plan.tensors.values())
        print_save_memory(ctx, before, written, largest)
    if ctx.rank == 0:
        print(f"saved checkpoint {out}" + (f" at step {step}" if step is not None else ""), flush=True)
