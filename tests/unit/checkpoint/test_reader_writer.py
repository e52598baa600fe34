"""Checkpoint writer/reader round trips and error paths, on real safetensors files
(checkpoint/writer.py, checkpoint/reader.py).
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from parallelizer.checkpoint import (load_full, load_shard, load_tensor,
                                     read_manifest, shard_slice,
                                     write_checkpoint)
from parallelizer.errors import CheckpointError
from parallelizer.plan.parallel_plan import ParallelPlan, TensorPlan


def make_plan(pp: int, tp: int, dp: int = 1) -> ParallelPlan:
    """A toy model: tied embedding on the first and last stage, column/row pair, norm, buffers."""
    last = pp - 1
    specs = [  # fqn, shape, dtype, tp_dim, stages, is_buffer
        ("embed.weight", (16, 8), "float32", 0, tuple(sorted({0, last})), False),
        ("layers.0.up.weight", (12, 8), "float32", 0, (0,), False),
        ("layers.0.up.bias", (12,), "bfloat16", -1, (0,), False),
        ("layers.0.down.weight", (8, 12), "float32", 1, (last,), False),
        ("norm.weight", (8,), "float16", None, (last,), False),
        ("rope.inv_freq", (4,), "float32", None, (0,), True),
        ("step", (), "int64", None, (last,), True),
    ]
    tensors = {f: TensorPlan(f, s, d, t, st, is_buffer=b) for f, s, d, t, st, b in specs}
    return ParallelPlan(mesh={"pp": pp, "dp": dp, "tp": tp}, zero_stage=0, schedule="1F1B",
                        microbatches=1, seed=0, tensors=tensors,
                        aliases={"lm_head.weight": "embed.weight"}, stages=())


def make_state_dict(plan: ParallelPlan) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for fqn, t in plan.tensors.items():
        dtype = getattr(torch, t.dtype)
        if dtype.is_floating_point:
            out[fqn] = torch.randn(t.shape, generator=g).to(dtype)
        else:
            out[fqn] = torch.randint(0, 1 << 40, t.shape, generator=g, dtype=dtype)
    return out


@pytest.fixture
def written(tmp_path):
    plan = make_plan(pp=2, tp=2)
    sd = make_state_dict(plan)
    return write_checkpoint(sd, plan, tmp_path / "ckpt"), plan, sd


# ---------------------------------------------------------------- writer / reader


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_bit_exact(tmp_path, pp, tp):
    plan = make_plan(pp, tp, dp=2)
    sd = make_state_dict(plan)
    out = write_checkpoint({**sd, "lm_head.weight": sd["embed.weight"]}, plan, tmp_path / "ckpt")
    files = sorted(os.listdir(out))
    assert files == sorted(["manifest.json"] + [f"pp{p}-tp{t}.safetensors"
                                                for p in range(pp) for t in range(tp)])
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp folder left
    full = load_full(out)
    assert full.keys() == sd.keys()
    for fqn, t in sd.items():
        assert full[fqn].dtype == t.dtype and torch.equal(full[fqn], t), fqn
    for p in range(pp):
        for r in range(tp):
            shard = load_shard(out, p, r, plan=plan)
            held = {f for f, tp_ in plan.tensors.items() if p in tp_.stages}
            assert shard.keys() == held
            for fqn in held:
                tplan = plan.tensors[fqn]
                expected = sd[fqn][shard_slice(tplan.shape, tplan.tp_dim, tp, r)]
                assert shard[fqn].shape == tplan.local_shape(tp)
                assert shard[fqn].dtype == expected.dtype and torch.equal(shard[fqn], expected)


def test_manifest_contents(written):
    out, plan, _ = written
    m = read_manifest(out)
    assert m["format_version"] == 2 and m["plan_hash"] == plan.hash()
    assert m["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    assert m["aliases"] == {"lm_head.weight": "embed.weight"}
    assert set(m["files"]) == {"pp0-tp0.safetensors", "pp0-tp1.safetensors",
                               "pp1-tp0.safetensors", "pp1-tp1.safetensors"}
    emb = m["tensors"]["embed.weight"]
    assert emb["shape"] == [16, 8] and emb["dtype"] == "float32" and not emb["is_buffer"]
    assert emb["tp_dim"] == 0 and emb["layout"] is None
    assert {(p["file"], p["tp_rank"], tuple(map(tuple, p["segments"]))) for p in emb["pieces"]} == {
        ("pp0-tp0.safetensors", 0, ((0, 0, 8),)), ("pp0-tp1.safetensors", 1, ((8, 0, 8),)),
        ("pp1-tp0.safetensors", 0, ((0, 0, 8),)), ("pp1-tp1.safetensors", 1, ((8, 0, 8),))}
    assert m["tensors"]["layers.0.up.bias"]["tp_dim"] == 0  # -1 normalised
    assert m["tensors"]["rope.inv_freq"]["is_buffer"]
    assert m["tensors"]["norm.weight"]["pieces"][0]["segments"] is None


def test_load_tensor_reads_any_region(written):
    out, _, sd = written
    w = sd["layers.0.down.weight"]  # (8, 12) sharded on dim 1 into two files
    assert torch.equal(load_tensor(out, "layers.0.down.weight", (slice(2, 5), slice(4, 9))),
                       w[2:5, 4:9])
    assert torch.equal(load_tensor(out, "layers.0.down.weight", (slice(0, 8), slice(0, 3))), w[:, :3])


def test_flipped_byte_is_a_sha256_mismatch(written):
    out, plan, _ = written
    f = out / "pp1-tp0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    expected = read_manifest(out)["files"]["pp1-tp0.safetensors"]["sha256"]
    with pytest.raises(CheckpointError, match="pp1-tp0.safetensors is corrupt") as e:
        load_shard(out, 1, 0, plan=plan)
    assert expected in str(e.value) and "sha256" in str(e.value)
    assert len([w for w in str(e.value).split() if len(w) == 64]) == 2  # both hashes
    load_shard(out, 0, 0, plan=plan)  # other files are fine
    with pytest.raises(CheckpointError, match="corrupt"):
        load_full(out)


def test_missing_shard(written):
    out, plan, _ = written
    (out / "pp0-tp1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"pp0-tp1\.safetensors is missing"):
        load_shard(out, 0, 1, plan=plan)


def test_plan_hash_mismatch(written):
    out, _, _ = written
    with pytest.raises(CheckpointError, match="is from another plan"):
        load_shard(out, 0, 0, plan=make_plan(pp=2, tp=1))


def test_missing_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="manifest.json does not exist.*written by `parallelize "
                                              "MODEL SPEC -o OUT` as OUT/checkpoint"):
        load_shard(tmp_path, 0, 0)
    with pytest.raises(CheckpointError, match=r"nope is not a parallelizer checkpoint \(no such folder\)"):
        read_manifest(tmp_path / "nope")


def test_missing_manifest_names_the_likely_mix_up(written, tmp_path):
    """A program folder (OUT instead of OUT/checkpoint) or a Hugging Face folder: the message
    says which, and the fix."""
    out, plan, sd = written
    prog = tmp_path / "prog"
    os.rename(out, tmp_path / "ckpt_moved")
    (prog / "checkpoint").parent.mkdir()
    os.rename(tmp_path / "ckpt_moved", prog / "checkpoint")
    with pytest.raises(CheckpointError, match=f"compiled program's folder; its checkpoint is {prog}/checkpoint"):
        read_manifest(prog)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.zeros(2)}, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"Hugging Face safetensors; convert them with "
                                              f"`parallelize import {hf} -o DST --plan OUT`"):
        read_manifest(hf)


def test_write_missing_tensor(tmp_path):
    plan = make_plan(1, 2)
    sd = make_state_dict(plan)
    del sd["norm.weight"]
    sd["extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"missing from the state_dict: norm\.weight") as e:
        write_checkpoint(sd, plan, tmp_path / "ckpt")
    assert "not in the plan: extra.weight" in str(e.value)
    assert not os.listdir(tmp_path)


def test_write_wrong_shape_or_dtype(tmp_path):
    plan = make_plan(1, 2)
    sd = make_state_dict(plan)
    sd["norm.weight"] = sd["norm.weight"].float()
    with pytest.raises(CheckpointError, match=r"norm\.weight: plan \(8,\) float16 vs tensor \(8,\) float32"):
        write_checkpoint(sd, plan, tmp_path / "ckpt")


def test_write_refuses_non_empty_dir_then_overwrites(written):
    out, plan, sd = written
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        write_checkpoint(sd, plan, out)
    plan1 = make_plan(pp=1, tp=1)
    write_checkpoint(make_state_dict(plan1), plan1, out, overwrite=True)
    assert read_manifest(out)["plan_hash"] == plan1.hash()
    assert sorted(os.listdir(out)) == ["manifest.json", "pp0-tp0.safetensors"]
    assert os.listdir(out.parent) == ["ckpt"]  # neither temp nor old folder left


def test_output_folder_gets_the_umask_permissions(tmp_path):
    """The temporary folder renamed onto the output is mkdtemp's (0o700): it must get what a
    plain mkdir gives, or the checkpoint is unreadable to the user's group (shared clusters)."""
    plan = make_plan(1, 1)
    old = os.umask(0o027)
    try:
        out = write_checkpoint(make_state_dict(plan), plan, tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)


def test_write_into_empty_existing_dir(tmp_path):
    plan = make_plan(1, 1)
    (tmp_path / "ckpt").mkdir()
    write_checkpoint(make_state_dict(plan), plan, tmp_path / "ckpt")
    assert load_full(tmp_path / "ckpt").keys() == plan.tensors.keys()
