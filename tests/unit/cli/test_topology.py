"""Topology (issue 18): rank -> node placement, tp groups kept inside a node, the
launch files, and the errors (cross-node tp, node count that does not match the mesh,
a bad cluster file), raised before anything is compiled."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from parallelizer.cli.parallelize import main as cli
from parallelizer.errors import PlanError, UserError
from parallelizer.cli.topology import resolve
from parallelizer.emit.launch import Topology, launch_files, placement_lines, tp_crossing

GPT = Path(__file__).resolve().parents[3] / "examples" / "gpt"
REPO_EXAMPLE = [str(GPT / "model.py"), str(GPT / "spec.yaml")]


def mesh(pp=1, dp=1, tp=1):
    return {"pp": pp, "dp": dp, "tp": tp}


def test_placement_table_rank_to_node_and_coordinates():
    lines = placement_lines(mesh(pp=2, dp=2, tp=2), resolve(mesh(pp=2, dp=2, tp=2), 2, 4))
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 8
    assert rows[5] == "| 5 | 1 | 1 | 1 | 0 | 1 |"  # rank 5: node 1, local 1, pp 1 dp 0 tp 1
    assert any("every tp group inside one node" in line for line in lines)
    unknown = placement_lines(mesh(tp=2), resolve(mesh(tp=2)))
    assert any("warning: tp groups were not checked" in line for line in unknown)


def test_tp_group_crossing_nodes_is_refused():
    with pytest.raises(PlanError, match=r"mesh.tp \(4\) with gpus_per_node \(2\).*ranks 0..3 would "
                                        r"span nodes 0 and 1.*use mesh.tp dividing 2"):
        resolve(mesh(tp=4), 2, 2)
    # 3 GPUs per node, tp=2: the group of ranks 2, 3 straddles nodes 0 and 1
    assert tp_crossing(mesh(dp=3, tp=2), Topology(2, 3, "x")) == [2, 3]
    assert tp_crossing(mesh(pp=2, dp=2, tp=2), Topology(2, 4, "x")) == []


def test_node_count_must_match_the_mesh(tmp_path):
    with pytest.raises(PlanError, match=r"2 node\(s\) x 4 GPU\(s\) = 8 ranks, but mesh pp=1 x dp=2 x "
                                        r"tp=2 = 4"):
        resolve(mesh(dp=2, tp=2), 2, 4)
    with pytest.raises(UserError, match="go together"):
        resolve(mesh(dp=2), 2, None)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 2\ngpus_per_node: 2\ngpu: a100-80gb\n"
                       "inter_node: {bandwidth_gb_s: 25, latency_us: 5}\n")
    assert resolve(mesh(dp=2, tp=2), cluster=cluster) == Topology(2, 2, f"cluster file {cluster}")
    cluster.write_text("nodes: two\n")
    with pytest.raises(UserError, match="nodes"):
        resolve(mesh(dp=2, tp=2), cluster=cluster)


def test_cli_refuses_before_compiling(tmp_path, capsys):
    code = cli([*REPO_EXAMPLE, "-o", str(tmp_path / "out"), "mesh.tp=4", "mesh.dp=1", "mesh.pp=1",
                "--nodes", "2", "--gpus-per-node", "2"])
    assert code == 2 and "span nodes 0 and 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_launch_files_counts_and_syntax(tmp_path):
    files = launch_files(Topology(3, 4, "x"))
    assert "torchrun --nnodes 3 --nproc-per-node 4" in files["launch.sh"]
    assert "--rdzv-backend c10d" in files["launch.sh"]
    sb = files["launch.sbatch"]
    assert "#SBATCH --nodes=3" in sb and "#SBATCH --gpus-per-node=4" in sb
    assert "#SBATCH --ntasks-per-node=1" in sb and "srun --nodes=3 --ntasks-per-node=1 torchrun " \
        "--nnodes 3 --nproc-per-node 4" in sb
    for name, text in files.items():  # both parse as shell scripts
        (tmp_path / name).write_text(text)
        subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)
