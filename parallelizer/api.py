"""The Python API: the compiler as a library call inside your own training loop.

The API and the CLI are two faces of one compiler: both go through
``compiler.compile_module`` and run on the same runtime (``parallelizer.runtime``).

Example (launched with ``torchrun --nproc-per-node 4 train.py``)::

    import parallelizer as pz
    spec = pz.load_spec("spec.yaml", overrides=["mesh.tp=2", "mesh.pp=2"])
    pm = pz.parallelize(model, spec, example_inputs=(input_ids,), loss_fn=loss_fn)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-4)
    for batch in loader:
        loss = pm.step(pm.shard_batch(batch))   # all microbatches, forward and backward
        opt.step(); opt.zero_grad()
    pm.save_checkpoint("ckpt/")
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint.slicing import local_piece
from .checkpoint.reader import load_shard
from .compiler import compile_module
from .errors import UserError
from .emit.program import Program
from .runtime.batching import dp_slice
from .runtime.clip import GradNorm
from .runtime.setup import RankContext, init
from .runtime.stage_builder import LocalStages, instantiate, load_into, stage_class_from_source
from .runtime.step import StepRunner
from .runtime.train import gather_full_state, save_checkpoint
from .frontend.model_file import default_loss
from .frontend.spec import Spec, load_spec

__all__ = ["load_spec", "compile", "parallelize", "ParallelModule", "Program", "clip_grad_norm_"]


def compile(model: torch.nn.Module, spec: Spec, example_inputs, loss_fn: Optional[Callable] = None,
            reference: bool = True) -> Program:
    """Trace, plan and rewrite ``model``; ``program.save(dir)`` writes what the CLI emits.

    Args:
        model: on cpu (weights resharded into the program) or on the meta device.
        example_inputs: a tuple or dict of tensors (a lone tensor is one positional input);
            dim 0 batch, dim 1 sequence (dynamic).
        loss_fn: ``loss_fn(outputs, batch) -> scalar`` for the reference step.
        reference: compute ``reference.safetensors`` on a copy of ``model`` (it is never modified).

    Raises:
        UserError: ``spec`` is not a Spec (use :func:`load_spec`); ``example_inputs`` is not
            tensors.
        CaptureError, PlanError: as the CLI (the message names the module and the fix).
    """
    return compile_module(model, _check_args(spec, example_inputs), spec, loss_fn, reference=reference)


def _check_args(spec, example_inputs):
    """The example batch as a tuple or dict of tensors (a lone tensor is one positional input).

    Raises:
        UserError: ``spec`` is not a :class:`Spec`, or ``example_inputs`` holds non-tensors.
    """
    if not isinstance(spec, Spec):
        raise UserError(f"spec must be a parallelizer Spec, got {type(spec).__name__}; build it with "
                        f"pz.load_spec('spec.yaml', overrides=[...]) (validated like the CLI's)")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    batch = example_inputs if isinstance(example_inputs, dict) else \
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else None
    values = list(batch.values()) if isinstance(batch, dict) else batch
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        seen = type(example_inputs).__name__ if values is None else \
            ", ".join(type(v).__name__ for v in values) or "nothing"
        raise UserError(f"example_inputs must be a tensor, or a tuple or dict of tensors (dim 0 "
                        f"batch, dim 1 sequence) as the model's forward takes them; got {seen}")
    return batch


def parallelize(model: torch.nn.Module, spec: Spec, example_inputs, loss_fn: Optional[Callable] = None,
                weights: Optional[str | Path] = None, device: Optional[str] = None) -> "ParallelModule":
    """This rank's part of ``model`` parallelized by ``spec``; call on every rank.

    Args:
        model: on cpu (this rank's slices are taken from it) or on the meta device with
            ``weights`` = a checkpoint folder in parallelizer's layout (each rank reads its
            own (pp, tp) file only).
        example_inputs: as for :func:`compile`.
        loss_fn: ``loss_fn(outputs, target) -> scalar``, a mean over samples; default: mean
            of squares of the first floating-point output.
        device: "cuda" (NCCL, GPU ``LOCAL_RANK``) or "cpu" (gloo); default cuda when available.

    Raises:
        UserError: not launched by torchrun (no process group and no RANK), or a world size
            other than ``mesh.dp * mesh.tp * mesh.pp``; the message says what to launch.
        CaptureError, PlanError, CheckpointError: as the CLI.
    """
    _check_args(spec, example_inputs)
    _check_launch(spec)
    program = compile(model, spec, example_inputs, loss_fn, reference=False)
    plan = program.plan
    ctx = init(plan, device)
    if program.state is None and weights is None:
        raise UserError("the model is on the meta device and no weights= checkpoint was given; "
                        "build it on cpu or pass weights=<checkpoint folder>")
    t, modules = ctx.tp_rank, []
    indices = plan.local_stages(ctx.pp_rank)
    for p in indices:
        cls = stage_class_from_source(program.sources[f"program/stage{p}.py"], p)
        if program.state is not None:
            shard = {fqn: local_piece(program.state[fqn], tp_plan, plan.mesh["tp"], t)
                     for fqn, tp_plan in plan.tensors.items() if p in tp_plan.stages}
            source = "the model"
        else:
            shard, source = load_shard(weights, p, t, plan), str(weights)
        modules.append(instantiate(cls, plan, ctx, shard, source, p))
    stage = LocalStages(indices, modules)
    return ParallelModule(stage, plan, ctx, loss_fn or default_loss)


def clip_grad_norm_(module: "ParallelModule", max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``module.clip_grad_norm_(max_norm, norm_type)`` (:meth:`ParallelModule.clip_grad_norm_`).

    Raises:
        UserError: ``module`` is not a ParallelModule (a plain module: use torch's own).
    """
    if not isinstance(module, ParallelModule):
        raise UserError(f"pz.clip_grad_norm_ takes the ParallelModule pz.parallelize returned, got "
                        f"{type(module).__name__}; for a plain module use torch.nn.utils.clip_grad_norm_")
    return module.clip_grad_norm_(max_norm, norm_type)


def _check_launch(spec: Spec) -> None:
    need = spec.mesh.dp * spec.mesh.tp * spec.mesh.pp
    launch = (f"launch your script with `torchrun --nproc-per-node {need} your_script.py` "
              f"(mesh dp={spec.mesh.dp} x tp={spec.mesh.tp} x pp={spec.mesh.pp} = {need} ranks)")
    if dist.is_initialized():
        world = dist.get_world_size()
    elif "RANK" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    else:
        raise UserError(f"pz.parallelize runs on every rank of a distributed job, but no process "
                        f"group is initialised and this process was not started by torchrun; {launch}")
    if world != need:
        raise UserError(f"the spec's mesh needs {need} ranks but the world size is {world}; {launch}")


class ParallelModule:
    """This rank's stage of a parallelized model, with the step that drives all ranks.

    Attributes:
        module: the local stage module (an ``nn.Module`` whose parameters keep the original
            FQNs, tp-sharded and, when dp > 1, FSDP2-sharded); call it yourself when pp = 1.
            With ``pipeline.virtual_stages`` > 1 a rank runs several stages: ``module`` is
            the first, ``stages`` holds them all.
        stages: this rank's stage modules (:class:`parallelizer.runtime.stage_builder.LocalStages`).
        plan: the ParallelPlan. ``pp_rank``, ``dp_rank``, ``tp_rank``: this rank's coordinates.
    """

    def __init__(self, stages: LocalStages, plan, ctx: RankContext, loss_fn):
        self.stages, self.plan, self.ctx = stages, plan, ctx
        self.module = stages.modules[0]
        self._runner = StepRunner(stages, plan, ctx, loss_fn)
        self._norm = GradNorm(stages, plan, ctx)
        self.pp_rank, self.dp_rank, self.tp_rank = ctx.pp_rank, ctx.dp_rank, ctx.tp_rank

    def parameters(self):
        return self.stages.parameters()

    def named_parameters(self):
        return self.stages.named_parameters()

    def shard_batch(self, batch):
        """This data-parallel rank's contiguous share of a global ``batch``, on its device.

        Raises:
            ValueError: the batch size is not divisible by dp x microbatches.
        """
        return dp_slice(self.plan, batch, self.dp_rank, self.ctx.device)

    def step(self, inputs, target=None) -> torch.Tensor:
        """Forward and backward of every microbatch of ``inputs`` (this rank's data-parallel
        share: a tuple or dict like the example inputs); gradients accumulate in
        ``parameters()`` for your optimizer.

        Args:
            target: what ``loss_fn`` gets beside the outputs (default: ``inputs``), any
                pytree of tensors with the batch in dim 0.

        Returns:
            The loss (0-dim fp32 tensor), the mean over the whole global batch, on every rank.
        """
        return self._runner.step(inputs, target)[0]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model, across every rank: the
        global norm of all gradients, each element of the original model counted once over
        tp shards, pipeline stages and FSDP shards (tied and copied weights once;
        runtime/clip.py), and every local gradient scaled by ``min(1, max_norm / (norm +
        1e-6))``. Call it on every rank after :meth:`step`, before ``opt.step()``; torch's own
        ``clip_grad_norm_(pm.parameters())`` would see only this rank's shards (under pp a
        per-stage norm).

        Returns:
            The total norm before clipping (0-dim fp32, the same on every rank).

        Raises:
            ValueError: ``norm_type`` other than 2 or inf.
        """
        return self._norm.clip_(max_norm, norm_type)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm of :meth:`clip_grad_norm_`, without clipping."""
        return self._norm.norm(norm_type)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the weights in the plan's sharded layout, atomically: every rank writes its
        own shards (``pp{s}-tp{t}-dp{d}.safetensors``; no gather, no pickle) and rank 0 the
        ``manifest.json``, last (runtime/sharded_save.py). ``reshard``, ``export`` and
        :meth:`load_checkpoint` read it. Collective: call on every rank.

        Raises:
            UserError: ``path`` is a file, a compiled program, or a folder of other files."""
        save_checkpoint(self.stages, self.plan, self.ctx, Path(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load weights saved by :meth:`save_checkpoint` (or an OUT/checkpoint) for this plan.

        Raises:
            CheckpointError: corrupt file, another plan, or a missing tensor.
        """
        for index, module in self.stages:
            load_into(module, self.plan, load_shard(path, index, self.tp_rank, self.plan),
                      self.ctx, str(path), index)

    def full_state_dict(self) -> Optional[dict]:
        """Full tensors under the original (canonical) FQNs on global rank 0; None on the
        other ranks. Collective: call on every rank. An explicit gather for small models:
        rank 0 receives the whole model (pickled through ``gather_object``); to write a
        checkpoint use :meth:`save_checkpoint`, which gathers nothing."""
        state = gather_full_state(self.stages, self.plan, self.ctx)
        if state is not None:  # tied names too, so model.load_state_dict(state) is strict-clean
            state.update({a: state[c] for a, c in self.plan.aliases.items() if c in state})
        return state

    def __repr__(self) -> str:
        m = self.plan.mesh
        n = sum(p.numel() for p in self.stages.parameters())
        blocks = [b for b, _ in self.stages.emitted_blocks()]
        held = f"{blocks[0]}..{blocks[-1]}" if blocks else "no blocks"
        return (f"ParallelModule(mesh pp={m['pp']} x dp={m['dp']} x tp={m['tp']}, rank "
                f"{self.ctx.rank} at (pp={self.pp_rank}, dp={self.dp_rank}, tp={self.tp_rank}), "
                f"stage(s) {self.stages.indices} of {self.plan.num_stages} holding {held}, {n:,} local parameter "
                f"elements, schedule {self.plan.schedule if m['pp'] > 1 else 'none'})")
