"""``run.py --train --steps N [--save DIR] [--resume DIR]``: train on ``batches()`` from
model.py (seeded synthetic batches shaped like the example inputs when it has none) and save
the trained weights, the AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``, in the
parameters' layout) and the step counter in the same sharded layout. ``--resume`` restores
all three (the data stream skips the batches already seen), so training continues as if
uninterrupted, on the program's own layout (reshard the checkpoint to it first). A model with
dropout also saves every rank's dropout stream states (``runtime/rng.py``) in the manifest's
``train.rng``, and ``--resume`` restores them on the same mesh."""
from __future__ import annotations

import base64
import itertools
from pathlib import Path

import torch

import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from ..checkpoint.reader import load_shard, read_manifest
from ..checkpoint.writer import OPTIM_STATES, optim_name, write_checkpoint
from ..errors import CheckpointError, UserError
from ..plan import ParallelPlan
from .batching import dp_slice, synthetic_batches
from . import rng
from .gather import full_tensor
from .data_parallel import make_stage_optimizer
from .setup import RankContext
from .step import StepRunner


def run_train(plan: ParallelPlan, spec: dict, stage, ctx: RankContext, loss_fn, model_module,
              steps: int, resume: Path | None = None):
    """Train ``steps`` steps (after the ``resume`` checkpoint's, when given); returns
    ``(losses, optimizer, last step number)``, losses being global means, on every rank."""
    ocfg = spec["optimizer"]
    runner = StepRunner(stage, plan, ctx, loss_fn)
    opt = make_stage_optimizer(stage.parameters(), ocfg["name"], ocfg["lr"], ocfg["weight_decay"],
                               plan.zero_stage, ctx)
    start = 0
    if resume is not None:
        start = load_optimizer_state(opt, stage, plan, ctx, Path(resume))
        restore_rng_state(read_manifest(Path(resume)), plan, ctx, start)
    source = itertools.islice(batch_source(plan, model_module, spec), start, None)
    losses = []
    for step, batch in zip(range(start, start + steps), source):
        opt.zero_grad(set_to_none=True)
        loss, _ = runner.step(dp_slice(plan, batch, ctx.dp_rank, ctx.device))
        opt.step()
        losses.append(loss.item())
        if ctx.rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    return losses, opt, start + len(losses)


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
    return int(manifest["train"]["step"])


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
    (None elsewhere). Collective over all ranks. Memory on rank 0 is the whole model; the
    streaming per-rank writer comes with the checkpoint issue."""
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


def check_save_target(out: Path) -> None:
    """A save may replace an earlier checkpoint (a folder with manifest.json), never other
    files, a compiled program, or the weights a program was compiled with.

    Raises:
        UserError: ``out`` is a file, a program folder (plan.json), an OUT/checkpoint, or a
            non-empty folder that is not a checkpoint.
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


def gather_optimizer_state(opt, stage, plan: ParallelPlan, ctx: RankContext) -> dict | None:
    """``{fqn: {"exp_avg", "exp_avg_sq", "step"}}`` at full shape on global rank 0 (None
    elsewhere); parameters without state (never given a gradient) are left out. Collective."""
    tp = plan.mesh["tp"]
    mine = {}
    for name, p in stage.named_parameters():
        fqn = plan.aliases.get(name, name)
        st = opt.state.get(p)
        if not st:
            continue
        full = {k: full_tensor(st[k], plan.tensors[fqn], ctx, tp).cpu() for k in ("exp_avg", "exp_avg_sq")
                if k in st}
        if ctx.dp_rank == 0 and ctx.tp_rank == 0 and full:
            mine[fqn] = {**full, "step": st["step"].detach().cpu().float()}
    return _merge_on_rank0(mine, ctx)


def save_checkpoint(stage, plan: ParallelPlan, ctx: RankContext, out: Path, opt=None,
                    step: int | None = None, optimizer: str = "") -> None:
    """Write the model (and, with ``opt``, its optimizer state and the step counter) to
    ``out`` in the plan's sharded layout, atomically (temporary folder, then rename) from
    global rank 0. Collective."""
    check_save_target(Path(out))  # on every rank, before any collective: all raise alike
    state = gather_full_state(stage, plan, ctx)
    optim = gather_optimizer_state(opt, stage, plan, ctx) if opt is not None else None
    rng_entry = rng_state_entry(plan, ctx) if opt is not None else None
    if state is not None:
        train = {"step": step, "optimizer": optimizer} if opt is not None else None
        if rng_entry is not None:
            train["rng"] = rng_entry
        write_checkpoint(state, plan, Path(out), overwrite=True, optim_state=optim, train=train)
        print(f"saved {len(state)} tensors to {out}", flush=True)
    dist.barrier()


def _coordinate(ctx: RankContext) -> str:
    return f"pp{ctx.pp_rank}.dp{ctx.dp_rank}.tp{ctx.tp_rank}"


def encode_rng_states(states: dict) -> dict:
    """``rng.state_dict()`` as JSON data: base64 of each state's bytes."""
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def rng_state_entry(plan: ParallelPlan, ctx: RankContext) -> dict | None:
    """The ``train.rng`` manifest entry on global rank 0: ``{"mesh": plan mesh, "states":
    {"pp{p}.dp{d}.tp{t}": {"<stream>.<device>": base64 generator state}}}`` (a few KiB per
    rank); None elsewhere and for a model without dropout. Collective."""
    if not plan.dropout:
        return None
    states = _merge_on_rank0({_coordinate(ctx): encode_rng_states(rng.state_dict())}, ctx)
    return None if states is None else {"mesh": dict(plan.mesh), "states": states}


def restore_rng_state(manifest: dict, plan: ParallelPlan, ctx: RankContext, step: int) -> None:
    """Put this rank's dropout streams where the saved run left them. A checkpoint saved on
    another mesh (resharded) or device type has no states for this rank: the streams are
    reseeded from the seed and ``step`` instead (fresh masks, not those of steps 1..step);
    rank 0 says so."""
    if not plan.dropout:
        return
    entry = manifest.get("train", {}).get("rng") or {}
    states = entry.get("states", {}).get(_coordinate(ctx))
    device = ctx.device.type
    if entry.get("mesh") == dict(plan.mesh) and states and \
            all(k.endswith("." + device) for k in states):
        rng.load_state_dict({k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8)
                             for k, v in states.items()})
        return
    rng.seed_streams(plan.seed, ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, plan.mesh["tp"], step)
    if ctx.rank == 0:
        saved = entry.get("mesh")
        print(f"note: the checkpoint holds no dropout RNG state for this mesh ({_mesh(plan.mesh)}, "
              f"{device}; saved for {_mesh(saved) if saved else 'none'}): dropout streams "
              f"reseeded from seed {plan.seed} and step {step}", flush=True)


def _mesh(m: dict) -> str:
    return f"pp={m['pp']} x dp={m['dp']} x tp={m['tp']}"
