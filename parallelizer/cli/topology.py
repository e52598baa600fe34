"""The compile command's topology: ``--nodes N --gpus-per-node G`` or ``--cluster FILE``,
checked against the mesh (a tp group must not cross nodes) before anything is compiled.
Placement and launch files: :mod:`parallelizer.emit.launch`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..advisor.cluster import load_cluster as load_cluster_file
from ..emit.launch import Topology, one_node, tp_crossing
from ..errors import PlanError, UserError


def load_cluster(path: Path) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of a cluster file, validated by the planner's schema
    (:func:`parallelizer.advisor.cluster.load_cluster`).

    Raises:
        ClusterError: the file is missing or does not validate (naming the key and value).
    """
    cluster = load_cluster_file(path)
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
        return one_node(mesh)
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
