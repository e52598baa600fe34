"""Cluster files (advisor/cluster.py): errors name the key, the value and the fix; the
shipped files load.
"""

import pytest

from parallelizer.errors import ClusterError
from parallelizer.advisor.cluster import GPUS, cluster_from_dict, load_cluster

A100 = dict(nodes=4, gpus_per_node=8, gpu="a100-80gb", inter_node={"bandwidth_gb_s": 25, "latency_us": 5})


# --- cluster file ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"gpu": "v100"}, ["unknown GPU 'v100'", "a100-80gb", "h200"]),
    ({"colour": "red"}, ["unknown key 'colour'"]),
    ({"nodes": 0}, ["nodes must be an integer >= 1", "0"]),
    ({"efficiency": 1.5}, ["efficiency must be null or a number in (0, 1]", "1.5"]),
    ({"inter_node": {"bandwidth_gb_s": -1}}, ["inter_node.bandwidth_gb_s must be a number > 0", "-1"]),
    ({"dtype": "fp8"}, ["dtype must be one of 'bf16', 'fp16', 'fp32'", "fp8"]),
    ({"usable_memory": 0}, ["usable_memory must be a number in (0, 1]", "0"]),
    ({"gpu": {"name": "x", "memory_gb": 10, "memory_bandwidth_gb_s": 1,
              "tflops": {"bf16": 1, "fp16": 1, "fp32": 1}}}, ["intra_node", "needs intra_node"]),
], ids=["unknown-gpu", "unknown-key", "nodes-0", "efficiency", "bandwidth", "dtype", "usable",
     "custom-no-intra"])
def test_cluster_errors_name_key_value_and_fix(change, words):
    with pytest.raises(ClusterError) as e:
        cluster_from_dict({**A100, **change}, "c.yaml")
    for w in words + ["c.yaml"]:
        assert w in str(e.value), (w, str(e.value))


def test_cluster_missing_key_and_file_errors(tmp_path):
    with pytest.raises(ClusterError, match="inter_node is missing"):
        cluster_from_dict({k: v for k, v in A100.items() if k != "inter_node"})
    with pytest.raises(ClusterError, match="does not exist.*specs/clusters"):
        load_cluster(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1\n")
    with pytest.raises(ClusterError, match="not valid YAML at line"):
        load_cluster(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ClusterError, match="must be a YAML mapping, got list"):
        load_cluster(bad)


def test_shipped_cluster_files_load_and_gpu_table_is_dense_datasheet_peak(tools):
    for f in (tools.repo / "specs" / "clusters").glob("*.yaml"):
        assert load_cluster(f).world >= 8
    c = cluster_from_dict({**A100, "gpu": "h100-sxm"})
    assert c.peak_flops == 989.5e12 and c.memory_bytes == 80e9
    assert cluster_from_dict({**A100, "dtype": "fp32"}).peak_flops == 19.5e12
    assert all("datasheet" in g.source for g in GPUS.values())
    # an 8-way group fits a node (NVLink, 300 GB/s); 16 ranks, or 8 ranks 2 apart, do not
    assert c.link(8, 1).bandwidth_gb_s == 450 and c.link(16, 1).bandwidth_gb_s == 25
    assert c.link(8, 2).bandwidth_gb_s == 25
