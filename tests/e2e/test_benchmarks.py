"""Smoke tests of benchmarks/: each script runs in --quick mode (tiny model, few steps) and
writes its table and JSON with the expected keys; the equal-loss check fails on a
mismatch; the analytical communication minimum follows Megatron-LM §3 / ZeRO."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def bench(name: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--json", str(out), *args],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return _written(name, out, p.stdout, args), p.stdout


def _written(name: str, out: Path, stdout: str, args) -> dict:
    data = json.loads(out.read_text())
    # --moe / --compression write NAME_moe / NAME_compression (their own default JSON files)
    assert data["benchmark"] in (name, f"{name}_{args[0].lstrip('-')}" if args else name)
    assert data["quick"] and "cpu" in data["machine"]
    assert data["table"] in stdout  # the printed table is the one in the JSON
    return data


def bench_warm(name: str, tmp_path: Path, tools, monkeypatch, capsys, *args: str) -> tuple[dict, str]:
    """``bench`` with the script's ``main`` run in this process and its compiles and torchrun
    launches (benchmarks/_common.run) forked from the warm server (``tools.run_command``):
    the same commands, without a fresh interpreter importing torch for each. test_compile_quick
    runs its script as a user does, every process fresh (its peak memory is a fresh process's)."""
    import importlib
    from benchmarks import _common

    def run(cmd, env=None, timeout=600, what=""):
        res = tools.run_command(cmd, env or _common.ENV, _common.REPO, timeout)
        if res.code != 0:
            raise _common.BenchmarkError(f"{what or cmd[2]} failed (exit {res.code}):\n"
                                         f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
        return res.stdout

    monkeypatch.setattr(_common, "run", run)
    monkeypatch.delenv("PZ_BENCH_SIZE", raising=False)  # communication.py sets it in-process
    out = tmp_path / f"{name}.json"
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--quick", "--json", str(out), *args])
    capsys.readouterr()
    importlib.import_module(f"benchmarks.{name}").main()
    stdout = capsys.readouterr().out
    return _written(name, out, stdout, args), stdout


def _check_run(run: dict, steps: int, warmup: int) -> None:
    """Both sides timed, losses equal and checked at every step."""
    assert run["checked_steps"] == steps + warmup
    ours, base = run["losses"]["ours"], run["losses"][run["baseline"]]
    assert len(ours) == len(base) == steps + warmup
    assert max(abs(a - b) for a, b in zip(ours, base)) == run["max_loss_diff"] <= 1e-5 + 1e-5 * abs(base[0])
    assert all(len(t) == steps and min(t) > 0 for t in run["times"].values())


def test_compile_quick(tmp_path):
    data, out = bench("compile", tmp_path)
    assert {r["kind"] for r in data["runs"]} == {"export", "parallelize"}
    assert data["time_ratio"] > 0 and 0.05 < data["peak_rss_gb"] < data["targets"]["peak_gb"]
    assert "<= 1.5x" in out and "<= 2.0 GB" in out


def test_overhead_quick(tmp_path, tools, monkeypatch, capsys):
    data, out = bench_warm("overhead", tmp_path, tools, monkeypatch, capsys, "--models", "llama-example")
    (run,) = data["runs"]
    _check_run(run, 3, 1)
    assert run["baseline"] == "eager" and run["mesh"] == {"dp": 1, "pp": 1, "tp": 1}
    assert run["ratio"] == pytest.approx(run["median_s"]["ours"] / run["median_s"]["eager"])
    assert "<= 1.05" in out


def test_communication_quick(tmp_path, tools, monkeypatch, capsys):
    # step_time runs the same _worker and native baseline; its equal-loss check is the one
    # test_overhead_quick and test_loss_check_fails_on_mismatch exercise
    data, out = bench_warm("communication", tmp_path, tools, monkeypatch, capsys, "--configs",
                           "tp2-dp2-fsdp")
    (run,) = data["runs"]
    rows = {(r["op"], r["dim"]): r for r in run["rows"]}
    # Megatron f/g: 4 all-reduces per layer per rank (4 layers, 4 ranks), + 2 for the
    # vocab_parallel embedding and head, + 3 for the cross-entropy (loss_parallel); ours is
    # exactly that, and so is torch-native's loss_parallel cross-entropy
    tp = rows[("allreduce_", "tp")]
    assert tp["calls"]["minimum"] == tp["calls"]["ours"] == (4 * 4 + 2 + 3) * 4
    assert tp["wire_bytes"]["ours"] == tp["wire_bytes"]["minimum"]
    assert ("allgather_", "tp") not in rows  # the logits are never gathered in a step
    # FSDP: gradients reduce-scattered once, as the minimum; both sides gathered parameters
    rs = rows[("_reduce_scatter_base_", "dp")]["wire_bytes"]
    assert rs["ours"] == rs["native"] == rs["minimum"] > 0
    # ... and all-gathered the parameters as the minimum says: forward, then backward for the
    # layers only (FSDP2 keeps the root gathered; an explicit reshard of the root re-gathered it)
    ag = rows[("_allgather_base_", "dp")]["wire_bytes"]
    assert ag["ours"] == ag["native"] == ag["minimum"] > 0
    assert len(run["collectives"]["ours"]) == 4 and run["max_loss_diff"] <= 1e-5


def test_loss_check_fails_on_mismatch():
    from benchmarks._worker import _check_losses

    class Side:
        def __init__(self, name):
            self.name = name

    sides = [Side("ours"), Side("native")]
    result = {"losses": {"ours": [2.0, 2.0], "native": [2.0, 2.001]}, "atol": 1e-5, "rtol": 1e-5}
    _check_losses(result, sides, 0)
    with pytest.raises(AssertionError, match="LOSS MISMATCH at step 2"):
        _check_losses(result, sides, 1)


def test_device_cuda_without_gpu_is_a_clear_error(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable, "-m", "benchmarks.step_time", "--device", "cuda"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--device cuda needs a CUDA GPU" in p.stderr and "--device cpu" in p.stderr


def test_planner_vs_measured_predicts_the_layouts_it_compiles():
    # what the benchmark predicts is what the overrides compile: same degrees, ZeRO stage,
    # microbatches, schedule, checkpointing, optimizer and sequence parallelism; >= 8 layouts
    # on <= 4 ranks, covering tp, pp, dp, ZeRO, microbatches and checkpointing
    from benchmarks.planner_vs_measured import BATCH, LAYOUTS, SPEC, candidate, kendall_tau, overrides
    from parallelizer.frontend.spec import load_spec
    assert len(LAYOUTS) >= 8
    for name, layout in LAYOUTS.items():
        spec, c = load_spec(SPEC, overrides(layout)), candidate(layout)
        m = spec.mesh
        assert (m.tp, m.pp, m.dp) == (c.tp, c.pp, c.dp) and c.world <= 4, name
        assert spec.zero_stage == c.zero_stage and spec.optimizer.name == c.optimizer, name
        assert (spec.activation_checkpointing.mode != "none") == c.recompute, name
        assert spec.tensor_parallel.sequence_parallel_mode != "false" and c.sequence_parallel, name
        if c.pp > 1:
            assert (spec.pipeline.microbatches, spec.pipeline.virtual_stages, spec.pipeline.schedule) == \
                (c.microbatches, c.virtual_stages, c.schedule), name
        assert c.micro_batch * c.microbatches * c.dp == BATCH, name
    kinds = list(LAYOUTS.values())
    assert {k[0] > 1 for k in kinds} == {k[1] > 1 for k in kinds} == {k[2] > 1 for k in kinds} == {True, False}
    assert {k[3] for k in kinds} >= {0, 1, 3} and any(k[6] for k in kinds) and len({k[4] for k in kinds}) >= 3
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(2 / 3)


def test_communication_moe_quick_skewed(tmp_path, tools, monkeypatch, capsys):
    # the skewed router sends every token to experts 0 and 1 (ep rank 0's): rank 0 sends no
    # row, rank 1 all of its (token, expert) rows, and the rank 1 experts get none at all;
    # the measured all-to-all bytes equal those from the unmodified model's routers, per rank
    data, out = bench_warm("communication", tmp_path, tools, monkeypatch, capsys, "--moe",
                           "--moe-configs", "dp2-ep2-skewed")
    (run,) = data["runs"]
    assert data["met"] and run["met"] and "measured == analytical: yes" in out
    rank0, rank1 = run["analytical"]
    layers, rows = 2, 4 * 8 * 2  # quick: 2 layers; 4 rows x 8 tokens per rank, top-2
    assert rank0["sent_rows"] == [0] * layers and rank1["sent_rows"] == [rows] * layers
    for m, a in zip(run["measured"], run["analytical"]):
        assert m["rows"] == a["rows"] and m["rows"]["calls"] == 4 * layers  # dispatch, combine, 2 backward
        assert m["counts"] == a["counts"] == {"calls": layers, "wire_bytes": layers * 2 * 8}
        assert a["rows"]["wire_bytes"] == 2 * rows * layers * 32 * 4  # hidden 32, fp32


def test_moe_analytical_counts_off_rank_rows_only():
    # dp2 x ep2, 4 experts (rank 0 holds 0-1, rank 1 2-3), one layer, hidden 8: rank 0
    # routes 3 rows off-rank, rank 1 two; rows for a rank's own experts are not sent
    import torch
    from benchmarks._comm import all_to_all_wire_bytes
    from benchmarks._moe_comm import analytical
    rows = [[torch.tensor([0, 1, 2, 3, 3])], [torch.tensor([0, 0, 2])]]
    r0, r1 = analytical(rows, experts=4, ep=2, hidden=8)
    assert (r0["sent_rows"], r0["received_rows"], r1["sent_rows"], r1["received_rows"]) == ([3], [2], [2], [3])
    assert r0["rows"] == r1["rows"] == {"calls": 4, "wire_bytes": 2 * (3 + 2) * 8 * 4}
    assert r0["counts"] == {"calls": 1, "wire_bytes": 2 * 8}
    # the recorder's side: a (5, 8) fp32 send buffer split [2, 3] from rank 0 sends 3 rows
    x = torch.zeros(5, 8)
    assert all_to_all_wire_bytes(x, [2, 3], 0, 2) == 3 * 32 and all_to_all_wire_bytes(x, [2, 3], 1, 2) == 2 * 32
    assert all_to_all_wire_bytes(torch.zeros(4, dtype=torch.int64), [], 0, 2) == 16  # equal splits


def test_step_time_moe_quick(tmp_path, tools, monkeypatch, capsys):
    data, out = bench_warm("step_time", tmp_path, tools, monkeypatch, capsys, "--moe")
    run = data["run"]
    assert run["meshes"]["ep2"]["dp"] == run["meshes"]["ep2"]["ep"] == 2 and run["meshes"]["ep2"]["tp"] == 1
    assert run["meshes"]["tp2"]["tp"] == 2 and run["meshes"]["tp2"]["ep"] == 1
    assert run["checked_steps"] == 3 + 1 and run["max_loss_diff"] <= 1e-5
    assert all(len(t) == 3 and min(t) > 0 for t in run["times"].values())
    assert run["ratio"] == pytest.approx(run["median_s"]["ep2"] / run["median_s"]["tp2"])
    assert "ep2/tp2" in out
