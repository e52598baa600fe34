"""Process group, device mesh and this rank's coordinates for the emitted program."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..plan.parallel_plan import MESH_DIMS, ParallelPlan
from . import rng
from .expert_parallel import set_ep_group
from .tp import set_tp_group


@dataclass
class RankContext:
    mesh: DeviceMesh
    device: torch.device
    pp_rank: int
    dp_rank: int
    tp_rank: int
    fsdp_mesh: DeviceMesh | None = None  # 1-D (dp) or, under HSDP, 2-D (dp_replicate, dp_shard)
    sync_groups: dict = field(default_factory=dict)  # rank tuple -> group (plan.grad_sync)
    compression: object = None  # runtime/compression.GradCompression, set by apply_data_parallel
    ep_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp) under expert parallelism (plan.ep > 1)

    @property
    def ep_rank(self) -> int:
        """This rank's place among the ranks splitting the experts (0 without ep)."""
        return self.ep_mesh.get_local_rank("ep") if self.ep_mesh is not None else 0

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def group(self, dim: str):
        return self.mesh[dim].get_group()

    def my_sync_groups(self, plan: ParallelPlan, kind: str) -> dict:
        """key -> the process group of ``plan.grad_sync`` entries of ``kind`` this rank is in
        (tied: stage tuple; replicated_heads: kv head count)."""
        self.sync_groups.update(_sync_groups(plan, self.sync_groups))  # a re-placed plan's new ones
        out = {}
        for entry in plan.grad_sync:
            key = tuple(entry["key"]) if isinstance(entry["key"], list) else entry["key"]
            for ranks in entry["ranks"]:
                if entry["kind"] == kind and self.rank in ranks:
                    out[key] = self.sync_groups[tuple(ranks)]
        return out


def world_size_error(plan: ParallelPlan, run_py: str) -> str | None:
    """One line when WORLD_SIZE differs from the plan's mesh (checked before any collective,
    so a wrong launch fails at once instead of hanging)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == plan.world_size:
        return None
    m = plan.mesh
    return (f"run.py: this program was compiled for mesh pp={m['pp']} x dp={m['dp']} x "
            f"tp={m['tp']} = {plan.world_size} ranks but WORLD_SIZE is {world}; launch it with "
            f"torchrun --nproc-per-node {plan.world_size} {run_py}")


def init(plan: ParallelPlan, device_type: str | None) -> RankContext:
    """Init the process group (NCCL + one GPU per rank on CUDA, else gloo) and the mesh
    ``(pp, dp, tp)``; set the tp group used by the Megatron f/g operators and seed this
    rank's dropout streams from ``plan.seed`` (runtime/rng.py)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" not in os.environ:  # plain `python run.py` on a one-rank mesh
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device_type == "cuda" else None,
                                **_restart_rendezvous())
    mesh = init_device_mesh(device_type, tuple(plan.mesh[d] for d in MESH_DIMS),
                            mesh_dim_names=MESH_DIMS)
    if plan.mesh["tp"] > 1:
        set_tp_group(mesh["tp"].get_group())
    ctx = RankContext(mesh, device, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"),
                      mesh.get_local_rank("tp"), _fsdp_mesh(plan, mesh, device_type),
                      _sync_groups(plan))
    if plan.ep > 1:
        ctx.ep_mesh = ep_mesh(plan, mesh, device_type)
        set_ep_group(ctx.ep_mesh["ep"].get_group())
    rng.seed_streams(plan.seed, ctx.pp_rank, ctx.dp_rank, ctx.tp_rank, plan.mesh["tp"])
    return ctx


def ep_mesh(plan: ParallelPlan, mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """The 4-D mesh ``(pp, edp, ep, tp)`` expert parallelism runs on: dp rank ``d`` is ep
    rank ``d % ep`` of expert-data-parallel replica ``d // ep`` (ep carved out of dp, the
    innermost dp ranks together, as torchtitan's ``ep`` borrows from ``dp_shard``). The ep
    ranks of one replica split the experts and exchange tokens; the edp ranks hold the same
    experts and sum their gradients."""
    m, ep = plan.mesh, plan.ep
    shape = (m["pp"], m["dp"] // ep, ep, m["tp"])
    return DeviceMesh(device_type, mesh.mesh.reshape(shape), mesh_dim_names=("pp", "edp", "ep", "tp"))


def _sync_groups(plan: ParallelPlan, made: dict | None = None) -> dict:
    """One process group per rank list of ``plan.grad_sync`` not in ``made``, created once
    per process by every rank in the same order (``new_group`` is collective; a plan
    re-placed by ``with_schedule`` may need groups the first one did not)."""
    groups: dict = {}
    for entry in plan.grad_sync:
        if entry["kind"] == "partial_tp":  # the tp mesh dim's groups (step.py)
            continue
        for ranks in entry["ranks"]:
            key = tuple(ranks)
            if key not in groups and key not in (made or {}):
                groups[key] = dist.new_group(ranks)
    return groups


def _fsdp_mesh(plan: ParallelPlan, mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``mesh["dp"]``, or under HSDP (``dp_replicate`` > 1) a
    2-D ``(dp_replicate, dp_shard)`` mesh whose rank order is that of ``dp`` (row-major), so
    dp rank ``r`` is replica ``r // dp_shard``, shard ``r % dp_shard``."""
    rep = plan.dp_replicate
    if rep == 1:
        return mesh["dp"]
    m = plan.mesh
    shape = (m["pp"], rep, m["dp"] // rep, m["tp"])
    hsdp = DeviceMesh(device_type, mesh.mesh.reshape(shape),
                      mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return hsdp["dp_replicate", "dp_shard"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restart_rendezvous() -> dict:
    """Under ``torchrun --max-restarts``, a restarted attempt's process group gets a store
    prefix of its own: with the default keys a restarted rank could read the address a rank
    of the killed attempt published and fail to connect (gloo ``connectFullMesh``:
    connection refused, seen under load in tests/distributed/test_restart.py). Empty (torch's
    default env:// rendezvous) on the first attempt and outside torchrun."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                        is_master=not agent and rank == 0, timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"parallelizer/attempt{attempt}", tcp),
            "rank": rank, "world_size": world}

