"""Memory model: bytes per rank of the program a spec compiles to (``parallelize estimate``).

Model states follow ZeRO (Rajbhandari et al. 2020, §3.1): with mixed-precision Adam a
parameter costs 2 (fp16 weights) + 2 (fp16 gradients) + K = 12 (fp32 master weights,
momentum, variance) = 16 bytes before sharding; ZeRO-1 shards the K bytes over the N data-
parallel ranks, ZeRO-2 the gradients too, ZeRO-3 everything (§5, Figure 1). Our program
keeps FSDP2's split of the same 16 bytes under ``mixed_precision``: the sharded parameter
is the fp32 master copy (4), its gradient fp32 (4), AdamW's ``exp_avg`` and ``exp_avg_sq``
fp32 (8); the ``param_dtype`` copy exists only while a unit is all-gathered.

Per rank the estimate is exact bookkeeping rather than a formula: the emitted stage class
is instantiated with FakeTensors (no storage; its tensors carry this rank's tp-local shapes), FSDP2's
``Shard(0)`` is applied as ``torch.chunk`` does it, and ZeRO-1's partition repeats
``ZeroRedundancyOptimizer``'s greedy largest-first assignment. Activations are the bytes
of the tensors autograd saves for backward (``saved_tensors_hooks`` on a forward of one
microbatch on FakeTensors, parameters excluded, one count per storage), which is the quantity
Korthikanti et al. 2022 (§4, Eq. 1-2: ``sbh(34 + 5as/h)`` per layer without tp) count by
hand; a checkpointed block keeps only its inputs (their §4.1, full recomputation) and
recomputes one block at a time in backward.

A pp rank runs ``pipeline.virtual_stages`` stages (the plan's ``StagePlan.rank``: loop or V
placement), so its model states are the sums over its stages, and its activations the
peak, over the schedule's own action list for that rank (torch's ``pipeline_order``:
:func:`parallelizer.plan.schedules.compute_actions`), of the bytes of the microbatches
whose forward has run and whose backward has not finished: a forward adds its stage's
bytes per microbatch, a full backward (or, under the zero-bubble schedules' split
backward, the weight-gradient action, which still needs the saved inputs) frees them.
That gives all ``m`` microbatches under GPipe and ``min(pp - stage, m)`` under 1F1B
(Narayanan et al. 2021, §2.2), and the interleaved and V schedules' counts likewise.

Under expert parallelism (``mesh.ep``) the emitted stage already holds a rank's E/ep
experts, which no FSDP2 unit shards or gathers (they sit outside it, as at run time), so an
expert weight, its gradient and its optimizer state count 1/ep of the layer's experts on
every rank, at any ZeRO stage; the forward gives an ep rank's shapes under balanced routing,
and ``alltoall_buffers`` is the largest dispatch or combine (send, receive and regrouped
rows) alive at once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .activations import DTYPE_BYTES, stage_activations
from ..plan.parallel_plan import ParallelPlan
from ..runtime.data_parallel import expert_params

ADAM_STATES = 2  # exp_avg, exp_avg_sq (Loshchilov & Hutter 2019)
STEP_BYTES = 4   # AdamW's per-parameter ``step``: a float32 scalar tensor


# --- the ZeRO paper's figures (no model) -----------------------------------------------------

def zero_figures(psi: float, n: int, k: int = 12) -> list[dict]:
    """Model-state bytes per device for Psi parameters on N devices (Rajbhandari et al.
    2020, §5.1, Figure 1; K = 12 for mixed-precision Adam). Returns one dict per stage with
    ``stage``, ``name``, ``formula`` and ``bytes``."""
    rows = [(0, "DDP (baseline)", f"(2 + 2 + K)*Psi = {4 + k}*Psi", (4 + k) * psi),
            (1, "ZeRO-1 (P_os)", f"(2 + 2)*Psi + K*Psi/N = 4*Psi + {k}*Psi/N", 4 * psi + k * psi / n),
            (2, "ZeRO-2 (P_os+g)", f"2*Psi + (2 + K)*Psi/N = 2*Psi + {2 + k}*Psi/N",
             2 * psi + (2 + k) * psi / n),
            (3, "ZeRO-3 (P_os+g+p)", f"(2 + 2 + K)*Psi/N = {4 + k}*Psi/N", (4 + k) * psi / n)]
    return [{"stage": s, "name": name, "formula": f, "bytes": b} for s, name, f, b in rows]


def format_zero_figures(psi: float, n: int, stages, k: int = 12) -> str:
    lines = [f"ZeRO model-state memory per device, Psi = {psi:g} parameters, N = {n} data-parallel "
             f"ranks, K = {k} (mixed-precision Adam; Rajbhandari et al. 2020, Sec. 5.1, Fig. 1)"]
    for row in zero_figures(psi, n, k):
        if row["stage"] in stages:
            lines.append(f"  zero_stage {row['stage']}  {row['name']:<18} {row['formula']:<43} "
                         f"= {row['bytes'] / 1e9:7.2f} GB  ({row['bytes']:.4g} bytes)")
    return "\n".join(lines)


# --- per-rank bookkeeping of a compiled program ----------------------------------------------

@dataclass
class RankEstimate:
    rank: int
    pp: int
    dp: int
    tp: int
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    gathered_parameters: int  # transient: unsharded FSDP units alive at once in fwd/bwd
    activations_per_microbatch: int  # one microbatch through every local stage
    microbatches_in_flight: int  # (stage, microbatch) pairs held at the activation peak
    activations: int  # peak held over the schedule + one block's recompute under checkpointing
    total: int
    alltoall_buffers: int = 0  # transient: the largest expert-parallel dispatch / combine


def fsdp_rows(n: int, shards: int, index: int) -> int:
    """Rows of dim 0 that FSDP2's ``Shard(0)`` gives shard ``index`` of ``shards``
    (``torch.chunk``: ceil(n / shards) each, the last ones shorter or empty)."""
    chunk = math.ceil(n / shards) if n else 0
    return max(0, min(chunk, n - index * chunk))


def local_numel(t: torch.Tensor, shards: int, index: int) -> int:
    if t.dim() == 0 or shards == 1:
        return t.numel()
    return fsdp_rows(t.shape[0], shards, index) * math.prod(t.shape[1:])


def zero1_partition(params: list, n: int) -> list[list]:
    """``ZeroRedundancyOptimizer._partition_parameters``: largest first, each to the rank
    with the fewest elements so far (first such rank on ties)."""
    sizes, out = [0] * n, [[] for _ in range(n)]
    for p in sorted(params, key=lambda t: t.numel(), reverse=True):
        r = sizes.index(min(sizes))
        out[r].append(p)
        sizes[r] += p.numel()
    return out


def _optimizer_bytes(numels: list[int], elem: int, optimizer: str) -> int:
    if optimizer != "adamw":
        return 0  # SGD without momentum keeps no state
    return sum(ADAM_STATES * n * elem + STEP_BYTES for n in numels)


def model_states(stage, plan: ParallelPlan, dp_rank: int, optimizer: str) -> dict:
    """Parameters, gradients, optimizer state and buffers (bytes) of ``stage`` on data-parallel
    rank ``dp_rank``: this rank's emitted stages (a :class:`LocalStages` of FakeTensor
    modules, tp-local shapes; a weight held by two local stages counts twice, as the
    runtime holds two Parameters). ZeRO-1 partitions the parameters of all of them at once,
    as the runtime builds one optimizer over ``LocalStages.parameters()``."""
    params = list(stage.parameters())
    dp, z = plan.mesh["dp"], plan.zero_stage
    shards = dp // plan.dp_replicate if z >= 2 else 1
    index = dp_rank % shards
    elem = {id(p): p.element_size() for p in params}
    experts = {id(p) for p in expert_params(stage, plan)}  # E/ep rows, outside FSDP2
    local = {id(p): p.numel() if id(p) in experts else local_numel(p, shards, index)
             for p in params}
    param_bytes = sum(local[id(p)] * elem[id(p)] for p in params)
    edp = dp // plan.ep  # ZeRO-1's group under ep: the ranks holding the same experts
    if z == 1 and edp > 1:
        mine = zero1_partition(params, edp)[dp_rank // plan.ep]
        opt = sum(_optimizer_bytes([p.numel()], p.element_size(), optimizer) for p in mine)
    else:
        opt = sum(_optimizer_bytes([local[id(p)]], elem[id(p)], optimizer) for p in params)
    buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
    return {"parameters": param_bytes, "gradients": param_bytes, "optimizer": opt, "buffers": buffers}


def gathered_bytes(stage, plan: ParallelPlan) -> int:
    """Unsharded parameters alive at once under FSDP2, in ``param_dtype``: every local
    stage whole under ZeRO-2 (kept from forward to backward); under ZeRO-3 each local
    stage's root (FSDP2 does not reshard a root after forward) plus the 1 + prefetch
    largest blocks; 0 under ZeRO-0/1 (the parameters are the full local tensors already).
    ``stage``: this rank's :class:`LocalStages`."""
    if plan.zero_stage < 2:
        return 0
    elem = DTYPE_BYTES[plan.param_dtype]
    blocks = [b for _, b in stage.emitted_blocks()]
    experts = {id(p) for p in expert_params(stage, plan)}  # never all-gathered
    sizes = sorted((sum(p.numel() for p in b.parameters() if id(p) not in experts)
                    for b in blocks), reverse=True)
    total = sum(p.numel() for p in stage.parameters() if id(p) not in experts)
    if plan.zero_stage == 2:
        return total * elem
    root = total - sum(sizes)
    return (root + sum(sizes[:1 + max(plan.prefetch_forward, plan.prefetch_backward)])) * elem


def held_activations(plan: ParallelPlan, per_microbatch: dict) -> list[tuple[int, int]]:
    """Per pp rank: (peak activation bytes held, microbatches held at that peak), walking
    the rank's compute actions in the schedule's order (see the module docstring).
    ``per_microbatch``: stage index -> bytes one microbatch leaves saved in that stage.

    Raises:
        AssertionError (internal): torch's schedule places a stage on another rank than the plan.
    """
    from ..plan.schedules import compute_actions
    pp = plan.mesh["pp"]
    if pp == 1:
        return [(per_microbatch[0], 1)]
    out = []
    ranks = compute_actions(plan.schedule, pp, plan.virtual_stages, plan.microbatches)
    for rank, actions in enumerate(ranks):
        mine = set(plan.local_stages(rank))
        assert {s for _, s, _ in actions} == mine, (plan.schedule, rank, actions, mine)
        held = count = peak = peak_count = 0
        for kind, s, _ in actions:
            if kind == "F":
                held, count = held + per_microbatch[s], count + 1
                if held > peak:
                    peak, peak_count = held, count
            elif kind in "BW":
                held, count = held - per_microbatch[s], count - 1
        out.append((peak, peak_count))
    return out


def load_stage(source: str, index: int):
    """The emitted stage with FakeTensor parameters (call under a ``FakeTensorMode``): CPU
    kernels' shape and stride rules, no storage (a meta SDPA output has other strides
    than the CPU kernel's, which breaks the emitted ``view`` after it)."""
    from ..runtime.stage_builder import stage_class_from_source
    return stage_class_from_source(source, index, f"<estimate stage {index}>")("cpu")


def estimate_program(plan: ParallelPlan, sources: dict, batch, loss_fn, optimizer: str) -> list[RankEstimate]:
    """One :class:`RankEstimate` per global rank of ``plan`` (rank order of the mesh
    ``(pp, dp, tp)``, tp innermost); a pp rank holds the stages ``plan.local_stages`` names."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..runtime.stage_builder import LocalStages
    m = plan.mesh
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode:
        stages = [load_stage(sources[f"program/{st.module}.py"], st.index) for st in plan.stages]
        alltoall: list = []
        acts = stage_activations(stages, plan, batch, loss_fn, mode, alltoall=alltoall)
    held = held_activations(plan, {s: kept for s, (kept, _) in enumerate(acts)})
    out = []
    for p in range(m["pp"]):
        indices = plan.local_stages(p)
        local = LocalStages(indices, [stages[s] for s in indices])
        per_mb = sum(acts[s][0] for s in indices)
        peak, flight = held[p]
        activations = peak + max(acts[s][1] for s in indices)
        gathered = gathered_bytes(local, plan)
        buffers = max(alltoall[s] for s in indices)
        for d in range(m["dp"]):
            states = model_states(local, plan, d, optimizer)
            for t in range(m["tp"]):
                rank = (p * m["dp"] + d) * m["tp"] + t
                out.append(RankEstimate(rank, p, d, t, **states, gathered_parameters=gathered,
                                        activations_per_microbatch=per_mb,
                                        microbatches_in_flight=flight, activations=activations,
                                        total=sum(states.values()) + gathered + activations + buffers,
                                        alltoall_buffers=buffers))
    return out


def estimate_model_file(model_path: Path, spec) -> tuple[ParallelPlan, list[RankEstimate]]:
    """Compile ``model_path`` under ``spec`` on the meta device (no weights) and estimate
    every rank. Raises the compiler's UserErrors (ModelFileError, CaptureError, PlanError)."""
    from ..compiler import compile_module
    from ..frontend.model_file import load_model

    loaded = load_model(model_path, on_meta=True)
    program = compile_module(loaded.model, loaded.batch, spec, loaded.loss_fn,
                             model_file=Path(model_path))
    return program.plan, estimate_program(program.plan, program.sources, loaded.batch,
                                          loaded.loss_fn, spec.optimizer.name)


def as_json(plan: ParallelPlan, ranks: list[RankEstimate]) -> dict:
    return {"mesh": plan.mesh, "ep": plan.ep, "zero_stage": plan.zero_stage, "dp_replicate": plan.dp_replicate,
            "param_dtype": plan.param_dtype, "activation_checkpointing": plan.activation_checkpointing,
            "schedule": plan.schedule, "microbatches": plan.microbatches,
            "virtual_stages": plan.virtual_stages,
            "ranks": [asdict(r) for r in ranks]}
