"""``parallelize check``: a spec against a cluster, as findings with numbers and a fix.

Pure data: the spec's degrees, the cluster and the predicted memory of its fullest rank.
The pitfalls are the field's rules of thumb: tensor parallelism inside a node (its
all-reduces are on the critical path), at least 2 x pp microbatches (1F1B's bubble
(p-1)/(m+p-1) is over a third below that; Narayanan et al. 2021, §2.2), ZeRO-3 with
prefetch (otherwise every unit's all-gather is exposed), every rank within its GPU's memory,
the world equal to the cluster, and a global batch that splits exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .capture import capture_workload
from .cluster import load_cluster
from .step_time import Candidate, memory_of


@dataclass(frozen=True)
class Finding:
    severity: str   # "error" or "warning"
    key: str        # the spec key (or cluster key) it is about
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e9 else f"{x / 1e6:.3g} MB"


def check_spec(spec, cluster, memory_bytes: float | None = None, memory_detail: str = "",
               global_batch: int | None = None, micro_batch: int | None = None) -> list[Finding]:
    """Findings of ``spec`` (a ``parallelizer.frontend.spec.Spec``) on ``cluster`` (``Cluster``).

    Args:
        memory_bytes: predicted bytes of the fullest rank (None: not checked).
        global_batch, micro_batch: sequences per step and per microbatch (None: not checked).
    """
    out: list[Finding] = []
    m, pipe = spec.mesh, spec.pipeline
    world = m.dp * m.tp * m.pp
    gpn = cluster.gpus_per_node
    if world != cluster.world:
        out.append(Finding("error", "mesh", f"world size dp x tp x pp = {m.dp} x {m.tp} x {m.pp} = "
                           f"{world}, but the cluster has {cluster.nodes} x {gpn} = {cluster.world} "
                           f"GPUs; change mesh.dp to {cluster.world // (m.tp * m.pp)}"
                           if cluster.world % (m.tp * m.pp) == 0 else
                           f"world size dp x tp x pp = {world}, but the cluster has {cluster.world} "
                           f"GPUs, which tp x pp = {m.tp * m.pp} does not divide; pick tp and pp "
                           f"dividing {cluster.world}"))
    if m.tp > gpn:
        net = (f"at {cluster.inter_node.bandwidth_gb_s:g} GB/s " if cluster.inter_node is not None
               else "")
        out.append(Finding("warning", "mesh.tp", f"tp = {m.tp} spans {-(-m.tp // gpn)} nodes of "
                           f"{gpn} GPUs: its all-reduces cross the network {net}instead of "
                           f"NVLink; use tp <= {gpn} and put the rest into pp or dp"))
    mb = pipe.microbatches
    if m.pp > 1 and mb < 2 * m.pp:
        bubble = (m.pp - 1) / (mb + m.pp - 1)
        out.append(Finding("warning", "pipeline.microbatches", f"{mb} microbatches for pp = {m.pp} "
                           f"leave a bubble of (p-1)/(m+p-1) = {bubble:.0%} of the step (over a third "
                           f"below 2 x pp); use pipeline.microbatches >= {2 * m.pp} (4 x pp = "
                           f"{4 * m.pp} keeps it under 20 %)"))
    pf = spec.fsdp.prefetch
    if spec.zero_stage == 3 and (pf.forward == 0 or pf.backward == 0) and m.dp > 1:
        which = " and ".join(k for k, v in (("forward", pf.forward), ("backward", pf.backward)) if v == 0)
        out.append(Finding("warning", "fsdp.prefetch", f"zero_stage 3 with fsdp.prefetch.{which} = 0: "
                           f"every unit's all-gather waits on the critical path; set it to 1 (the "
                           f"default) or use zero_stage 2"))
    if memory_bytes is not None and memory_bytes > cluster.usable_memory_bytes:
        out.append(Finding("error", "memory", f"the fullest rank needs {_gb(memory_bytes)} "
                           f"({memory_detail}) but a {cluster.gpu_name} has "
                           f"{_gb(cluster.usable_memory_bytes)} usable (usable_memory "
                           f"{cluster.usable_memory:g} of {_gb(cluster.memory_bytes)}); raise zero_stage, tp or pp, enable "
                           f"activation_checkpointing.mode=full, or run `parallelize plan`"))
    if global_batch is not None:
        m_eff = mb if m.pp > 1 else 1
        b = micro_batch or 1
        need = m.dp * m_eff * b
        if global_batch % need:
            out.append(Finding("error", "global batch", f"--global-batch {global_batch} is not "
                               f"divisible by dp x microbatches x micro-batch size = {m.dp} x {m_eff} "
                               f"x {b} = {need}; use a multiple of {need}"))
    return out


def run_check(model_path, spec, cluster, global_batch=None, seq=None, micro_batch=None) -> list:
    """Findings of ``spec`` for ``model_path`` on ``cluster`` (a Cluster or a cluster file;
    ``check_spec``), memory by the analytical model at the spec's precision and
    micro-batch size."""

    if not hasattr(cluster, "world"):
        cluster = load_cluster(cluster)
    m, pipe = spec.mesh, spec.pipeline
    mbs = pipe.microbatches if m.pp > 1 else 1
    if micro_batch is None and global_batch:
        micro_batch = max(1, global_batch // (m.dp * mbs))
    workload = capture_workload(Path(model_path), seq)
    dtype = spec.mixed_precision.param_dtype if spec.zero_stage >= 2 else "fp32"
    at_precision = cluster.model_copy(update={"dtype": dtype})
    pf = spec.fsdp.prefetch
    lay = Candidate(m.tp, m.pp, m.dp, micro_batch or 1, mbs, spec.zero_stage, pipe.virtual_stages,
                 spec.activation_checkpointing.mode != "none", m.dp_replicate,
                 1 if pf.forward is None else pf.forward, pipe.schedule if m.pp > 1 else None,
                 spec.tensor_parallel.sequence_parallel_mode != "false", spec.optimizer.name,
                 ep=m.ep)
    mem, parts = memory_of(workload, at_precision, lay)
    detail = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in parts.items() if k != "pp_rank")
    detail += f", pp rank {parts['pp_rank']}, micro-batch {lay.micro_batch} x {workload.seq} tokens"
    return check_spec(spec, cluster, mem, detail, global_batch, micro_batch)
