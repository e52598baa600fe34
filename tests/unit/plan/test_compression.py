"""data_parallel.compression: every spec error it adds, the plan settings, the bytes model,
and the Top-K hook's arithmetic on a one-rank gloo group (in-process)."""
from __future__ import annotations

import math

import pytest
import torch

from parallelizer.plan.compression import (payload_bytes, plan_settings, powersgd_elements,
                                           reduce_dtype)
from parallelizer.errors import SpecError
from parallelizer.frontend.spec import load_spec

DP2 = ["mesh.dp=2", "zero_stage=0"]


def spec(tmp_path, *overrides):
    path = tmp_path / "spec.yaml"
    path.write_text("")
    return load_spec(path, list(overrides))


def error(tmp_path, *overrides) -> str:
    with pytest.raises(SpecError) as info:
        spec(tmp_path, *overrides)
    return str(info.value)


@pytest.mark.parametrize("overrides, expected", [
    (["data_parallel.compression=fp16"],
     "data_parallel.compression=fp16 compresses the data-parallel gradient reduction, but mesh.dp is 1"),
    (DP2 + ["data_parallel.compression=zstd"],
     "data_parallel.compression must be one of 'none', 'fp16', 'bf16', 'powersgd', 'topk'"),
    (DP2 + ["data_parallel.compression=topk", "data_parallel.powersgd.rank=2"],
     "data_parallel.powersgd.rank=2 is set but data_parallel.compression=topk; set "
     "data_parallel.compression=powersgd or remove data_parallel.powersgd.rank"),
    (DP2 + ["data_parallel.compression=powersgd", "data_parallel.topk.ratio=0.1"],
     "data_parallel.topk.ratio=0.1 is set but data_parallel.compression=powersgd"),
    (DP2 + ["data_parallel.error_feedback=false"],
     "data_parallel.error_feedback=false applies to powersgd and topk only, but data_parallel.compression=none"),
    (DP2 + ["data_parallel.compression=powersgd", "data_parallel.powersgd.start_iter=1"],
     "data_parallel.powersgd.start_iter must be null (= 10) or an integer >= 2"),
    (DP2 + ["data_parallel.compression=powersgd", "data_parallel.powersgd.rank=0"],
     "data_parallel.powersgd.rank must be null (= 1) or an integer >= 1"),
    (DP2 + ["data_parallel.compression=topk", "data_parallel.topk.ratio=1.5"],
     "data_parallel.topk.ratio must be null (= 0.01) or a number in (0, 1]"),
    (["mesh.dp=2", "zero_stage=3", "data_parallel.compression=powersgd"],
     "data_parallel.compression=powersgd under zero_stage 3: FSDP2 reduce-scatters gradients inside "
     "the shard group and torch has no hook to compress a reduce-scatter"),
    (["mesh.dp=4", "zero_stage=2", "data_parallel.compression=topk"],
     "set mesh.dp_replicate > 1, a divisor of mesh.dp=4"),
    (["mesh.dp=2", "zero_stage=2", "data_parallel.compression=fp16", "mixed_precision.reduce_dtype=bf16"],
     "data_parallel.compression=fp16 is FSDP2's reduce dtype under zero_stage 2, but "
     "mixed_precision.reduce_dtype=bf16 asks for another; remove one of them"),
    (["mesh.dp=4", "mesh.dp_replicate=2", "zero_stage=3", "data_parallel.compression=powersgd",
      "mixed_precision.param_dtype=bf16"],
     "data_parallel.compression=powersgd with mixed_precision (param_dtype=bf16"),
])
def test_compression_spec_errors(tmp_path, overrides, expected):
    assert expected in error(tmp_path, *overrides)


def test_settings_defaults_and_reduce_dtype(tmp_path):
    s = spec(tmp_path, *DP2, "data_parallel.compression=powersgd")
    assert plan_settings(s) == {"method": "powersgd", "rank": 1, "start_iter": 10, "error_feedback": True}
    s = spec(tmp_path, *DP2, "data_parallel.compression=topk", "data_parallel.error_feedback=false")
    assert plan_settings(s) == {"method": "topk", "ratio": 0.01, "error_feedback": False}
    assert reduce_dtype(spec(tmp_path, "mesh.dp=2", "zero_stage=3", "data_parallel.compression=bf16")) == "bf16"
    assert reduce_dtype(spec(tmp_path, *DP2, "data_parallel.compression=bf16")) == "fp32"  # a DDP hook
    s = spec(tmp_path, "mesh.dp=4", "mesh.dp_replicate=2", "zero_stage=3", "data_parallel.compression=topk")
    assert plan_settings(s)["ratio"] == 0.01  # HSDP: allowed


def test_payload_bytes_follow_the_papers():
    shapes = [(64, 256), (256,), (96, 64)]
    full = (64 * 256 + 256 + 96 * 64) * 4
    assert payload_bytes(shapes, {"method": "none"})["compressed"] == full
    assert payload_bytes(shapes, {"method": "fp16"})["compressed"] == full // 2
    # PowerSGD rank r: r (n + m) per compressed n x m matrix; the bias goes whole
    got = payload_bytes(shapes, {"method": "powersgd", "rank": 2})["compressed"]
    assert got == (2 * (64 + 256) + 256 + 2 * (96 + 64)) * 4
    assert powersgd_elements((4, 4), 2) == (16, False)  # 2 (4 + 4) * 2 >= 16: not worth it
    # Top-K: ceil(ratio n) values + int32 indices per tensor
    k = math.ceil(0.01 * 64 * 256) + math.ceil(0.01 * 256) + math.ceil(0.01 * 96 * 64)
    assert payload_bytes(shapes, {"method": "topk", "ratio": 0.01})["compressed"] == k * 8


def test_topk_hook_keeps_largest_entries_and_the_rest_as_error(monkeypatch):
    import torch.distributed as dist
    from parallelizer.runtime.compression import FlatBucket, TopKState, topk_hook
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        state = TopKState(dist.group.WORLD, ratio=0.25, error_feedback=True)
        grads = torch.tensor([0.1, -4.0, 0.3, 2.0, 0.5, -0.2, 1.0, 0.05])
        buf = grads.clone()
        out = topk_hook(state, FlatBucket(0, buf, [(4,), (2, 2)], [0, 4])).wait()
        # per tensor, ceil(0.25 * 4) = 1 entry: -4.0 of the first, 1.0 of the second
        assert torch.equal(out, torch.tensor([0, -4.0, 0, 0, 0, 0, 1.0, 0]))
        assert torch.equal(state.error_dict[0], torch.tensor([0.1, 0, 0.3, 2.0, 0.5, -0.2, 0, 0.05]))
        # next step: the residual is added back, so 2.0 (+ 0 new) now wins in the first tensor
        out = topk_hook(state, FlatBucket(0, torch.zeros(8), [(4,), (2, 2)], [0, 4])).wait()
        assert torch.equal(out, torch.tensor([0, 0, 0, 2.0, 0.5, 0, 0, 0]))
    finally:
        dist.destroy_process_group()


def test_estimate_json_counts_dp_bytes_from_the_model(capsys):
    """``parallelize estimate --json``'s dp_communication against the GPT example's own
    parameter shapes (PowerSGD rank 2 under DDP at dp=2; HSDP 2 x 2 with fp16)."""
    import importlib.util
    import json
    from pathlib import Path
    from parallelizer.cli import parallelize as cli
    repo = Path(__file__).resolve().parents[3]
    mod_spec = importlib.util.spec_from_file_location("gpt_for_bytes", repo / "examples/gpt/model.py")
    gpt = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(gpt)
    shapes = [tuple(p.shape) for p in gpt.build_model().parameters()]
    args = ["estimate", str(repo / "examples/gpt/model.py"), str(repo / "examples/gpt/spec.yaml"), "--json",
            "mesh.tp=1", "mesh.dp=2", "zero_stage=0", "data_parallel.compression=powersgd",
            "data_parallel.powersgd.rank=2"]
    assert cli.main(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["dp_communication"]
    assert row["bytes"] == sum(math.prod(s) for s in shapes) * 4
    assert row["compressed_bytes"] == sum(powersgd_elements(s, 2)[0] for s in shapes) * 4
    args[5:] = ["mesh.tp=1", "mesh.dp=4", "mesh.dp_replicate=2", "zero_stage=3", "data_parallel.compression=fp16"]
    assert cli.main(args) == 0
    rs, ar = json.loads(capsys.readouterr().out)["dp_communication"]
    assert (rs["collective"], rs["group"], ar["collective"], ar["group"]) == \
        ("reduce-scatter", "dp_shard", "all-reduce", "dp_replicate")
    assert rs["compressed_bytes"] * 2 == rs["bytes"] and ar["compressed_bytes"] * 2 == ar["bytes"]
    assert ar["bytes"] == sum(-(-s[0] // 2) * math.prod(s[1:]) for s in shapes) * 4


def test_compression_state_files_refuse_another_program(tmp_path, monkeypatch):
    """write_state / load_state: a round trip restores the residuals (Top-K) and PowerSGD's
    memories, counter and generator exactly; a missing file, a corrupt one and one of other
    settings are CheckpointErrors naming the file and the fix."""
    import dataclasses
    import torch.distributed as dist
    from parallelizer.errors import CheckpointError
    from parallelizer.plan.parallel_plan import ParallelPlan
    from parallelizer.runtime.compression import GradCompression, load_state, write_state
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29614")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        settings = {"method": "topk", "ratio": 0.5, "error_feedback": True}
        plan = ParallelPlan(mesh={"pp": 1, "dp": 2, "tp": 1}, zero_stage=0, schedule="1f1b", microbatches=1,
                            seed=0, tensors={}, aliases={}, stages=(), compression=settings)
        comp = GradCompression(settings, dist.group.WORLD)
        comp.state.error_dict = {0: torch.arange(4.0), 3: torch.ones(2, 3)}
        name, entry = write_state(comp, plan, tmp_path, rank=0)
        files = {name: entry}
        fresh = GradCompression(settings, dist.group.WORLD)
        load_state(fresh, plan, tmp_path, 0, torch.device("cpu"), files=files)
        assert fresh.state.error_dict.keys() == {0, 3}
        assert torch.equal(fresh.state.error_dict[0], torch.arange(4.0))
        assert torch.equal(fresh.state.error_dict[3], torch.ones(2, 3))
        with pytest.raises(CheckpointError, match=r"no compression-rank1.safetensors, the error-feedback "
                                                  r"state of data_parallel.compression=topk .* resume with"):
            load_state(fresh, plan, tmp_path, 1, torch.device("cpu"), files=files)
        other = dataclasses.replace(plan, compression={**settings, "ratio": 0.1})
        with pytest.raises(CheckpointError, match=r"rank0.safetensors holds compression state of another "
                                                  r"program \(settings: saved .*'ratio': 0.5.*this program "
                                                  r".*'ratio': 0.1"):
            load_state(fresh, other, tmp_path, 0, torch.device("cpu"), files=files)

        psgd = {"method": "powersgd", "rank": 2, "start_iter": 2, "error_feedback": True}
        plan = dataclasses.replace(plan, compression=psgd)
        comp = GradCompression(psgd, dist.group.WORLD)
        comp.state.iter = 7
        comp.state.rng.standard_normal(5)  # move the generator off its seed
        comp.state.error_dict = {1: torch.randn(6)}
        comp.state.p_memory_dict = {1: torch.randn(3, 2)}
        comp.state.q_memory_dict = {1: torch.randn(2, 2)}
        name, entry = write_state(comp, plan, tmp_path, rank=0)
        fresh = GradCompression(psgd, dist.group.WORLD)
        load_state(fresh, plan, tmp_path, 0, torch.device("cpu"), files={name: entry})
        assert fresh.state.iter == 7
        assert fresh.state.rng.standard_normal(3).tolist() == comp.state.rng.standard_normal(3).tolist()
        for d in ("error_dict", "p_memory_dict", "q_memory_dict"):
            assert torch.equal(getattr(fresh.state, d)[1], getattr(comp.state, d)[1]), d
        data = bytearray((tmp_path / name).read_bytes())
        data[-5] ^= 0xFF  # one bit pattern of the generator's last key word
        (tmp_path / name).write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"compression-rank0.safetensors is corrupt: sha256"):
            load_state(fresh, plan, tmp_path, 0, torch.device("cpu"), files={name: entry})
        # a file its manifest vouches for, but not one write_state wrote (no metadata)
        from safetensors.torch import save_file
        from parallelizer.checkpoint.format import sha256_file
        save_file({"error_dict.x": torch.zeros(2)}, str(tmp_path / name))
        entry = {"sha256": sha256_file(tmp_path / name), "bytes": (tmp_path / name).stat().st_size}
        with pytest.raises(CheckpointError, match=r"compression-rank0.safetensors is not compression "
                                                  r"state this parallelizer wrote \(KeyError"):
            load_state(fresh, plan, tmp_path, 0, torch.device("cpu"), files={name: entry})
    finally:
        dist.destroy_process_group()


def test_dp_collectives_under_ep_all_reduce_experts_over_their_replicas():
    """Mixtral (experts of 2 layers: 2 x (4x128x32 + 4x32x64) fp32) at dp4 x ep2, ZeRO-3: the
    expert gradients leave FSDP2's reduce-scatter and are all-reduced over the 2 ranks
    holding the same experts (each rank its 2 of 4); at dp2 x ep2 no rank shares its experts."""
    from pathlib import Path
    from parallelizer.compiler import compile_model
    from parallelizer.plan.compression import dp_collectives
    models = Path(__file__).resolve().parents[2] / "distributed" / "user_models"
    experts = 2 * (4 * 128 * 32 + 4 * 32 * 64) * 4

    def rows(*overrides):
        spec = load_spec(models / "spec.yaml", ["pipeline.microbatches=1", *overrides])
        plan = compile_model(models / "mixtral_train.py", spec, weights=False).plan
        return {(r["collective"], r["group"], r["ranks"]): r["bytes"] for r in dp_collectives(plan)}
    ep1, ep2 = rows("mesh.dp=4"), rows("mesh.dp=4", "mesh.ep=2")
    dense = ep1[("reduce-scatter", "dp", 4)] - experts
    assert ep2 == {("all-reduce", "edp", 2): experts // 2, ("reduce-scatter", "dp", 4): dense}
    assert rows("mesh.dp=2", "mesh.ep=2") == {("reduce-scatter", "dp", 2): dense}
