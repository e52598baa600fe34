"""Data parallelism over the dp mesh dim, by ZeRO stage (Rajbhandari et al. 2020, §5):

- 0: DDP (torch's composable ``replicate``, which keeps the original FQNs). Under pipeline
  parallelism DDP's reducer cannot follow several forwards before their backwards (1F1B),
  so there the gradients are averaged over dp after the schedule's step instead
  (:func:`all_reduce_grads`), which is what DDP computes, without the overlap;
- 1: DDP + ``ZeroRedundancyOptimizer`` (optimizer state partitioned over dp; under
  expert parallelism over edp, :func:`zero1_group`);
- 2: FSDP2 ``fully_shard`` per block with ``reshard_after_forward=False`` (gradients and
  optimizer state sharded; parameters stay gathered between forward and backward);
- 3: FSDP2 per block with ``reshard_after_forward=True`` (parameters sharded too), except a
  block whose forward returns one of its parameters to the code after it
  (``EmittedModule.RETURNS_PARAMETERS``), kept gathered until its backward as at 2.

FSDP2 options (stages 2 and 3, spec ``fsdp.*``, ``mixed_precision.*``, ``mesh.dp_replicate``):
HSDP shards over ``dp_shard`` and replicates over ``dp_replicate`` (a 2-D mesh; FSDP2
reduce-scatters then all-reduces the gradients); ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)`` keeps the sharded parameters, gradients and optimizer state in fp32 (the
master copy) and all-gathers/computes in ``param_dtype``; ``CPUOffloadPolicy`` keeps the
sharded parameters, gradients and optimizer state on the CPU. Explicit prefetch
(:func:`set_prefetch`) is per stage: the next pipeline stage's blocks live on other ranks.

Gradient compression (spec ``data_parallel.compression``, ``runtime/compression.py``): a DDP
comm hook at zero_stage 0/1, the same hook on one flat bucket after the schedule under pp > 1,
FSDP2's reduce dtype for fp16/bf16 at zero_stage 2/3, and under HSDP with powersgd/topk
FSDP2 over ``dp_shard`` with the hook as the all-reduce over ``dp_replicate``.
"""
from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .compression import GradCompression
from .optim import make_optimizer
from .setup import RankContext


def apply_data_parallel(stage: torch.nn.Module, ctx: RankContext, plan) -> None:
    """Wrap ``stage`` for data parallelism in place by ``plan.zero_stage`` (no-op when
    dp = 1, except for FSDP2 mixed precision or offload, which apply at dp = 1 too)."""
    zero_stage = plan.zero_stage
    if zero_stage in (0, 1) and plan.param_dtype != "fp32":  # fp32 master weights, autocast
        _autocast_forward(stage, ctx.device.type, TORCH_DTYPES[plan.param_dtype])
    fsdp_options = plan.param_dtype != "fp32" or plan.reduce_dtype != "fp32" or plan.offload
    if ctx.mesh["dp"].size() == 1 and not (zero_stage >= 2 and fsdp_options):
        return
    method = plan.compression.get("method", "none")
    if zero_stage in (0, 1):
        if method != "none" and ctx.compression is None:
            ctx.compression = GradCompression(plan.compression, ctx.group("dp"))
        if ctx.mesh["pp"].size() > 1:
            return  # StepRunner averages gradients after the schedule (all_reduce_grads)
        from torch.distributed._composable.replicate import replicate  # imports torch.jit: lazily
        # find_unused_parameters: a weight the loss does not use (BERT's pooler) must not
        # leave DDP's reducer waiting for its gradient (and keeps buckets from being rebuilt,
        # so a compression hook's per-bucket state keeps its layout across steps and resumes)
        replicate(stage, process_group=ctx.group("dp"), find_unused_parameters=True,
                  ignored_modules=expert_modules(stage, plan))
        if ctx.compression is not None:
            ctx.compression.register_ddp(stage)
        return
    kw = fsdp_kwargs(plan, ctx)
    # each ep rank holds other experts: synced by sync_expert_grads instead; a 0-dim
    # parameter (ReZero's gate, CLIP's logit_scale) FSDP2 refuses to shard ("fully_shard
    # doesn't support scalar parameters"): held whole, averaged by sync_scalar_grads
    ignored = set(expert_params(stage, plan)) if plan.ep > 1 else set()
    ignored |= set(scalar_params(stage))
    if ignored:
        kw["ignored_params"] = ignored
    hooked = method in ("powersgd", "topk")  # spec: only under HSDP at zero_stage 2/3
    if hooked:  # shard over dp_shard; the hook is the all-reduce over dp_replicate
        if ctx.compression is None:
            ctx.compression = GradCompression(plan.compression, ctx.fsdp_mesh["dp_replicate"].get_group())
        kw["mesh"] = ctx.fsdp_mesh["dp_shard"]
    blocks = [block for _name, block in stage.emitted_blocks()]
    # FSDP2 warns at every forward that a stage returning a view would lose its pre-backward
    # hook to an in-place op on it; what the stage returns goes to the pipeline's send (made
    # contiguous, passes/split_stages.py) or to the loss, never written in place by the
    # program: the warning, on every rank of every step, only alarmed
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStage\d+\) returned "
                                              r"a view tensor")
    for block in blocks:
        # a block returning its parameter (a weight penalty read after it) keeps it gathered
        # until backward: resharded, the caller would read freed memory (zoo 21 F4, SIGSEGV)
        fully_shard(block, **({**kw, "reshard_after_forward": False}
                              if getattr(block, "RETURNS_PARAMETERS", ()) else kw))
    # The root (embedding, final norm, LM head) is needed again at once by backward: under
    # ZeRO-3 leave it to FSDP2's root default (None: kept gathered, as torchtitan does); an
    # explicit True re-gathered it for every backward (benchmarks/communication.py).
    fully_shard(stage, **{**kw, "reshard_after_forward": None if kw["reshard_after_forward"] else False})
    if hooked:
        for unit in blocks + [stage]:
            ctx.compression.add_fsdp_unit(unit)
    set_prefetch(blocks, plan.prefetch_forward, plan.prefetch_backward)
    if plan.param_dtype != "fp32":
        _autocast_forward(stage, ctx.device.type, TORCH_DTYPES[plan.param_dtype])


def _autocast_forward(stage: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run the stage's forward under ``torch.autocast(dtype)`` besides FSDP2's policy: the
    exported graph keeps the dtype casts it was traced with (an RMSNorm's ``.to(float32)``
    and its cast back to the fp32 input dtype), which would feed fp32 activations into a
    matmul with ``param_dtype`` weights; autocast casts both operands of such ops."""
    inner = stage.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)
    stage.forward = forward


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_kwargs(plan, ctx: RankContext) -> dict:
    """``fully_shard`` keyword arguments of the plan: mesh (1-D or HSDP 2-D), reshard after
    forward by ZeRO stage, mixed precision and offload policies."""
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[plan.param_dtype],
                              reduce_dtype=TORCH_DTYPES[plan.reduce_dtype])
    # pin_memory needs CUDA; on a CPU-only run the offload is a no-op move (documented)
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if plan.offload else OffloadPolicy()
    return dict(mesh=ctx.fsdp_mesh if ctx.fsdp_mesh is not None else ctx.mesh["dp"],
                reshard_after_forward=plan.zero_stage == 3, mp_policy=mp, offload_policy=offload)


def set_prefetch(blocks: list, forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetch (``set_modules_to_forward_prefetch`` /
    ``..._backward_prefetch``): block i all-gathers blocks i+1..i+``forward`` after its own
    all-gather in forward, and blocks i-1..i-``backward`` in backward. Lists stop at the
    stage's ends (the neighbouring stage's blocks are on other ranks), so under a pipeline
    schedule a stage's first block is never prefetched from the previous microbatch's
    backward; 0 leaves FSDP2's implicit prefetch of the next unit."""
    for i, block in enumerate(blocks):
        if forward > 0 and i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + forward])
        if backward > 0 and i > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward):i][::-1])


def make_stage_optimizer(params, name: str, lr: float, weight_decay: float, zero_stage: int,
                         ctx: RankContext) -> torch.optim.Optimizer:
    """The spec's optimizer; under ZeRO-1 with dp > 1, partitioned over the dp group, or
    under expert parallelism over the expert-data-parallel group (:func:`zero1_group`)."""
    group = zero1_group(ctx)
    if zero_stage == 1 and group.size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports torch.jit: lazily
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, process_group=group.get_group(),
                                       lr=lr, weight_decay=weight_decay)
    return make_optimizer(params, name, lr, weight_decay)


def zero1_group(ctx: RankContext):
    """The 1-D mesh ZeRO-1 partitions the optimizer over: dp; under expert parallelism edp,
    the ``dp / ep`` ranks holding the same experts. ``ZeroRedundancyOptimizer`` broadcasts
    each updated parameter from the rank owning its state, which over all of dp would copy
    one ep rank's experts onto another's; within edp every rank holds the same tensors (the
    dense ones, averaged over dp, too). Megatron-LM's distributed optimizer likewise shards
    expert state over the expert-data-parallel group."""
    return ctx.ep_mesh["edp"] if ctx.ep_mesh is not None else ctx.mesh["dp"]


def expert_params(stage, plan) -> list:
    """The parameters of ``stage`` split over ep (``TensorPlan.experts``), in order."""
    return [p for name, p in stage.named_parameters()
            if getattr(plan.tensors.get(plan.aliases.get(name, name)), "experts", None) is not None]


def dense_params(stage, plan) -> list:
    """The parameters of ``stage`` not split over ep: the ones dp averages."""
    mine = {id(p) for p in expert_params(stage, plan)}
    return [p for p in stage.parameters() if id(p) not in mine]


def expert_modules(stage, plan) -> list:
    """The modules directly holding expert parameters (DDP's ``ignored_modules``)."""
    mine = {id(p) for p in expert_params(stage, plan)}
    return [m for m in stage.modules() if any(id(p) in mine for p in m.parameters(recurse=False))]


def ignored_dense_params(stage, plan) -> list:
    """The parameters DDP leaves out with :func:`expert_modules` that are no expert's (GPT-OSS's
    expert biases, (E, N), beside the stacked weights, are held whole by every ep rank): their
    gradients are averaged over dp by :func:`sync_ignored_dense_grads`."""
    if plan.ep == 1 or plan.zero_stage >= 2:
        return []
    mine = {id(p) for p in expert_params(stage, plan)}
    seen: dict = {}
    # a rank's LocalStages (stage_builder.py) lists its stage modules; or one stage module
    for module in stage.modules if isinstance(stage.modules, list) else [stage]:
        for m in expert_modules(module, plan):
            for p in m.parameters():
                if id(p) not in mine:
                    seen.setdefault(id(p), p)
    return list(seen.values())


def sync_ignored_dense_grads(stage, plan, ctx: RankContext, manual_dp: bool) -> None:
    """Average over dp the gradients of :func:`ignored_dense_params` (DDP left them out; they
    were never reduced: a wrong gradient at ep > 1, zero_stage 0/1, a break test), unless the
    step averaged every dense gradient itself (``manual_dp``: under pp > 1)."""
    if manual_dp or ctx.mesh["dp"].size() == 1:
        return
    grads = [p.grad for p in ignored_dense_params(stage, plan) if p.grad is not None]
    if grads:
        _average_over_dp(grads, ctx)


def sync_expert_grads(stages, plan, ctx: RankContext) -> None:
    """Expert gradients as data parallelism would give them: each ep rank's expert
    gradient already sums what every rank of its ep group routed to it (the dispatch's
    backward all-to-all), so sum over the expert-data-parallel replicas holding the same
    experts and divide by dp, the mean DDP / FSDP2 take over the other parameters."""
    if plan.ep == 1:
        return
    grads = [p.grad for p in expert_params(stages, plan) if p.grad is not None]
    if not grads:
        return
    if ctx.ep_mesh["edp"].size() > 1:
        _sum_flat(grads, ctx.ep_mesh["edp"].get_group())
    for g in grads:
        g.div_(plan.mesh["dp"])


def scalar_params(stage) -> list:
    """The 0-dim parameters of ``stage``: FSDP2 cannot shard them."""
    return [p for p in stage.parameters() if p.dim() == 0]


def sync_scalar_grads(stage, plan, ctx: RankContext) -> None:
    """Under FSDP2 (zero_stage 2/3) at dp > 1, average the gradients of the 0-dim
    parameters it left out (:func:`scalar_params`) over dp, as it averages the others."""
    if plan.zero_stage < 2 or plan.mesh["dp"] == 1:
        return
    grads = [p.grad for p in scalar_params(stage) if p.grad is not None]
    if not grads:
        return
    flat = torch.stack(grads)
    torch.distributed.all_reduce(flat, group=ctx.group("dp"))
    for g, synced in zip(grads, flat / plan.mesh["dp"]):
        g.copy_(synced)


def all_reduce_grads(params, ctx: RankContext) -> None:
    """Average gradients over the dp group in one coalesced all-reduce (DDP's result), or
    through the compression hook on one flat bucket."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return
    if ctx.compression is not None:
        ctx.compression.reduce(grads, params)
        return
    _average_over_dp(grads, ctx)


def _average_over_dp(grads: list, ctx: RankContext) -> None:
    """The mean of ``grads`` over the dp group, in place (DDP's result)."""
    _sum_flat(grads, ctx.group("dp"))
    for g in grads:
        g.div_(ctx.mesh["dp"].size())


def _sum_flat(grads: list, group) -> None:
    """All-reduce (sum) ``grads`` over ``group`` in place, as one coalesced flat buffer."""
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
