"""``parallelize calibrate`` (advisor/calibrate.py, calibrate_comm.py, cli/calibrate.py): a
reduced calibration on 2 processes writes the cluster file's ``measured:`` section, and the
planner then predicts from it; launch and file errors name the key and the fix.
"""
import datetime
import time
from pathlib import Path

import pytest
import yaml

from parallelizer.advisor.cluster import cluster_from_dict, load_cluster
from parallelizer.advisor.measured import COLLECTIVES
from parallelizer.advisor.step_time import Candidate, predict
from parallelizer.advisor.workload import from_shape, parse_shape
from parallelizer.cli.calibrate import main, write_measured
from parallelizer.errors import ClusterError

ENTRY = Path(__file__).with_name("calibrate_entry.py")
CPU2 = """# this machine as 2 ranks
nodes: 1
gpus_per_node: 2
gpu: {name: cpu, memory_gb: 4, memory_bandwidth_gb_s: 10, tflops: {bf16: 0.05, fp16: 0.05, fp32: 0.1}}
dtype: fp32
"""


def test_calibrate_then_predict_on_two_processes(tools, tmp_path):
    t0 = time.perf_counter()
    path = tmp_path / "cpu2.yaml"
    path.write_text(CPU2)
    res = tools.launch(ENTRY, 2, path, timeout=110).wait()
    assert res.code == 0, res.explain()
    assert "wrote measured: into" in res.stdout, res.stdout
    text = path.read_text()
    assert text.startswith("# this machine as 2 ranks")        # the file's own lines kept
    cluster = load_cluster(path)
    m = cluster.measured
    assert m.ranks == 2 and m.backend == "gloo" and m.device_type == "cpu" and m.date
    assert m.device.endswith(f"2 rank(s) on 1 node(s), torch {__import__('torch').__version__}")
    assert len(m.matmul["fp32"]) == 8 and all(p[3] > 0 for p in m.matmul["fp32"])   # 2 x 2 x 2 grid
    fits = m.collectives["intra_node"]
    assert set(fits) == set(COLLECTIVES) and all(f[2].bandwidth_gb_s > 0 for f in fits.values())
    assert {"adamw", "adamw_dtensor", "sgd"} <= set(m.optimizer) and m.elementwise.latency_us > 0
    w = from_shape(parse_shape("layers=2,hidden=64,heads=4,vocab=128,seq=16,glu=1"))
    pred = predict(w, cluster, Candidate(2, 1, 1, 4, 1))
    b = pred.breakdown
    assert b["sources"]["compute"] == "measured" and b["sources"]["collectives"] == "measured"
    assert {c["source"] for c in b["collectives"]} == {"measured"}
    assert sum(b["terms"].values()) == pytest.approx(pred.step_s, rel=1e-9)
    # torch's pipelining runtime per compute action: each of a rank's 2 x M actions pays it
    assert m.pipeline is not None and m.pipeline.action_us >= 0
    pipe = predict(w, cluster, Candidate(1, 2, 1, 1, 4))
    assert pipe.terms["pp_runtime"] == pytest.approx(2 * 4 * m.pipeline.action_us * 1e-6, rel=1e-9)
    assert sum(pipe.terms.values()) == pytest.approx(pipe.step_s, rel=1e-9)
    assert time.perf_counter() - t0 < 60


def test_quick_calibration_takes_under_two_minutes(tools, tmp_path):
    # the default mode, as a user runs it: torchrun, gloo, 2 processes
    path = tmp_path / "cpu2.yaml"
    path.write_text(CPU2)
    t0 = time.perf_counter()
    res = tools.launch(ENTRY, 2, path, "quick", timeout=150).wait()
    seconds = time.perf_counter() - t0
    assert res.code == 0, res.explain()
    m = load_cluster(path).measured
    assert m.mode == "quick" and m.ranks == 2 and "2 rank(s) on 1 node(s)" in m.device
    assert datetime.datetime.fromisoformat(m.date).date() == datetime.date.today()
    assert len(m.matmul["fp32"]) == 64 and set(m.collectives["intra_node"]) == set(COLLECTIVES)
    assert seconds < 120, f"quick calibration took {seconds:.0f} s"


def test_calibrate_launch_errors(tmp_path, monkeypatch):
    path = tmp_path / "cpu2.yaml"
    path.write_text(CPU2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ClusterError, match=r"runs 4 processes but .*cpu2.yaml describes 1 x 2 = 2 GPUs"):
        main(["--cluster", str(path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ClusterError, match=r"1 processes per node but .* gpus_per_node: 2.*"
                                           r"--nproc-per-node 2"):
        main(["--cluster", str(path)])
    with pytest.raises(ClusterError, match="does not exist"):
        main(["--cluster", str(tmp_path / "none.yaml")])


def test_measured_section_is_replaced_and_validated(tmp_path):
    src = tmp_path / "c.yaml"
    src.write_text(CPU2 + "measured:\n  old: 1\nusable_memory: 0.8  # kept\n")
    section = {"date": "2026-12-01T00:00:00", "device": "test", "backend": "gloo", "ranks": 2,
               "matmul": {"fp32": [[16, 16, 16, 1e-3]]},
               "collectives": {"intra_node": {"all_reduce": {2: {"latency_us": 100.0, "bandwidth_gb_s": 1.0}}}}}
    write_measured(src, src, section)
    data = yaml.safe_load(src.read_text())
    assert data["measured"]["ranks"] == 2 and "old" not in data["measured"]
    assert data["usable_memory"] == 0.8 and "# kept" in src.read_text()
    bad = dict(section, matmul={"fp32": [[16, 16, 16, 1e-3]]}, speed=3)
    with pytest.raises(ClusterError, match="unknown key 'measured.speed'"):
        write_measured(src, tmp_path / "out.yaml", bad)
    cluster = cluster_from_dict(yaml.safe_load(src.read_text()))
    assert cluster.measured.collectives["intra_node"]["all_reduce"][2].latency_us == 100.0
