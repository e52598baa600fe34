"""Nodes and GPUs: where each rank runs, the tensor-parallel check, and the launch files.

Ranks are the row-major order of the mesh ``(pp, dp, tp)`` (tp innermost, as
``init_device_mesh`` lays them out, runtime/setup.py), and torchrun numbers them node by
node: rank ``r`` runs on node ``r // gpus_per_node`` as local rank ``r % gpus_per_node``.
So a tp group (``tp`` consecutive ranks) sits inside one node exactly when it does not
straddle a multiple of ``gpus_per_node``, and pipeline stages, the outermost dim, span
nodes (Megatron-LM's placement, Narayanan et al. 2021, §3.3: tensor parallelism inside a
node's fast interconnect, pipeline parallelism across nodes).

The topology comes from ``--nodes N --gpus-per-node G``, or from a cluster file
(``--cluster FILE``; issue 17 defines it; this reads only its ``nodes`` and
``gpus_per_node``), else one node holding every rank. With a known topology a tp group
crossing nodes is a PlanError at compile time; without one, report.md warns.

``OUT/launch.sh`` (torchrun, c10d rendezvous) and ``OUT/launch.sbatch`` (Slurm: srun of
torchrun, one agent per node) are written from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import PlanError, UserError


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int
    source: Optional[str]   # where it came from; None: not given (one node assumed)

    @property
    def known(self) -> bool:
        return self.source is not None


def load_cluster(path: Path) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of a cluster file, validated by the planner's schema
    (:func:`parallelizer.planning.cluster.load_cluster`).

    Raises:
        ClusterError: the file is missing or does not validate (naming the key and value).
    """
    from .planning.cluster import load_cluster as load
    cluster = load(path)
    return cluster.nodes, cluster.gpus_per_node


def resolve(mesh: dict, nodes: Optional[int] = None, gpus_per_node: Optional[int] = None,
            cluster: Optional[Path] = None) -> Topology:
    """The topology for ``mesh`` ({"pp", "dp", "tp"}), checked (module docstring).

    Raises:
        PlanError: nodes x gpus_per_node differs from the mesh's world size, or a tp group
            would cross nodes (names tp, gpus_per_node and the fix).
        UserError: only one of --nodes / --gpus-per-node, or with --cluster too.
    """
    world = mesh["pp"] * mesh["dp"] * mesh["tp"]
    if cluster is not None and (nodes or gpus_per_node):
        raise UserError("pass either --cluster FILE or --nodes/--gpus-per-node, not both")
    if (nodes is None) != (gpus_per_node is None):
        raise UserError("--nodes and --gpus-per-node go together (e.g. --nodes 2 --gpus-per-node 8)")
    if cluster is not None:
        nodes, gpus_per_node = load_cluster(cluster)
        source = f"cluster file {cluster}"
    elif nodes is not None:
        source = f"--nodes {nodes} --gpus-per-node {gpus_per_node}"
    else:
        return Topology(1, world, None)
    if nodes * gpus_per_node != world:
        raise PlanError(
            f"{source}: {nodes} node(s) x {gpus_per_node} GPU(s) = {nodes * gpus_per_node} ranks, "
            f"but mesh pp={mesh['pp']} x dp={mesh['dp']} x tp={mesh['tp']} = {world}; change the "
            f"mesh or the node count so that they agree")
    topo = Topology(nodes, gpus_per_node, source)
    crossing = tp_crossing(mesh, topo)
    if crossing:
        raise PlanError(
            f"mesh.tp ({mesh['tp']}) with gpus_per_node ({gpus_per_node}) from {source}: the tp "
            f"group of ranks {crossing[0]}..{crossing[-1]} would span nodes "
            f"{crossing[0] // gpus_per_node} and {crossing[-1] // gpus_per_node}, and every "
            f"Megatron all-reduce would cross the network; use mesh.tp dividing {gpus_per_node}")
    return topo


def tp_crossing(mesh: dict, topo: Topology) -> list[int]:
    """The ranks of the first tp group spanning two nodes ([] when every group fits one)."""
    tp, g = mesh["tp"], topo.gpus_per_node
    world = mesh["pp"] * mesh["dp"] * tp
    for start in range(0, world, tp):
        if start // g != (start + tp - 1) // g:
            return list(range(start, start + tp))
    return []


def placement_lines(mesh: dict, topo: Topology) -> list[str]:
    """report.md's ``## Placement`` section: rank -> node, local rank -> (pp, dp, tp)."""
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    if topo.known:
        head = (f"- topology: {topo.nodes} node(s) x {topo.gpus_per_node} GPU(s) ({topo.source}); "
                f"every tp group inside one node")
    else:
        head = (f"- topology: not given; assumed one node of {topo.gpus_per_node} processes. "
                + ("warning: tp groups were not checked against node boundaries; pass "
                   "--nodes N --gpus-per-node G (or --cluster FILE) to compile for a cluster"
                   if tp > 1 else "pass --nodes N --gpus-per-node G to plan for several nodes"))
    lines = ["", "## Placement", "", head,
             "- node numbers are torchrun's: under c10d rendezvous the agents take node ranks in "
             "the order they join", "",
             "| rank | node | local rank | pp | dp | tp |", "|---|---|---|---|---|---|"]
    for r in range(pp * dp * tp):
        lines.append(f"| {r} | {r // topo.gpus_per_node} | {r % topo.gpus_per_node} | "
                     f"{r // (dp * tp)} | {r // tp % dp} | {r % tp} |")
    return lines


LAUNCH_SH = """#!/usr/bin/env bash
# Generated by parallelizer: run this program on {nodes} node(s) x {nproc} process(es).
# Start this script once on every node; the agents meet at the c10d rendezvous endpoint
# MASTER_ADDR:MASTER_PORT (a host every node reaches; default 127.0.0.1:29500). Arguments
# go to run.py, e.g.  MASTER_ADDR=node0 ./launch.sh --train --steps 100 --save ckpt
# --save-every 10 --resume auto   (MAX_RESTARTS=R restarts the job after a failure).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
exec torchrun --nnodes {nodes} --nproc-per-node {nproc} \\
    --rdzv-backend c10d --rdzv-endpoint "${{MASTER_ADDR:-127.0.0.1}}:${{MASTER_PORT:-29500}}" \\
    --rdzv-id "${{RDZV_ID:-parallelizer}}" --max-restarts "${{MAX_RESTARTS:-0}}" \\
    "$HERE/run.py" "$@"
"""

LAUNCH_SBATCH = """#!/bin/bash
# Generated by parallelizer: Slurm job for this program, {nodes} node(s) x {nproc} GPU(s).
# Submit from the program folder (or set PARALLELIZER_OUT to it); arguments go to run.py:
#   cd OUT && sbatch launch.sbatch --train --steps 100 --save ckpt --save-every 10 --resume auto
#SBATCH --job-name=parallelizer
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={nproc}
#SBATCH --output=parallelizer-%j.out
set -euo pipefail
OUT="${{PARALLELIZER_OUT:-$SLURM_SUBMIT_DIR}}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${{MASTER_PORT:-29500}}"
srun --nodes={nodes} --ntasks-per-node=1 torchrun --nnodes {nodes} --nproc-per-node {nproc} \\
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \\
    --max-restarts "${{MAX_RESTARTS:-0}}" "$OUT/run.py" "$@"
"""


def launch_files(topo: Topology) -> dict[str, str]:
    """``{"launch.sh": ..., "launch.sbatch": ...}`` for ``topo``."""
    kw = dict(nodes=topo.nodes, nproc=topo.gpus_per_node)
    return {"launch.sh": LAUNCH_SH.format(**kw), "launch.sbatch": LAUNCH_SBATCH.format(**kw)}
