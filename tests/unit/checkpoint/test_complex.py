"""Complex tensors in checkpoints (issue 23: a Llama 3 reference model's ``freqs_cis`` rotary
table is a complex64 buffer): written as their real view (safetensors has no complex128 and
reads ``C64`` only from 0.7), named in the file's metadata, read back bit for bit by every
reader (load_full, load_shard, load_tensor, reshard, export, import, reference files).
checkpoint/format.py, stream.py, pieces.py, hf.py."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from parallelizer.checkpoint import load_full, load_shard, load_tensor, write_checkpoint
from parallelizer.checkpoint.format import load_tensors, save_tensors
from parallelizer.checkpoint.hf import load_hf_state_dict
from parallelizer.convert.export import export_hf, import_hf
from parallelizer.convert.reshard import reshard
from parallelizer.plan.parallel_plan import ParallelPlan, TensorPlan


def _plan(tp: int) -> ParallelPlan:
    specs = [  # fqn, shape, dtype, tp_dim, stages, is_buffer
        ("w", (8, 4), "float32", 0, (0,), False),
        ("freqs_cis", (16, 4), "complex64", None, (0, 1), True),  # every stage reads it
        ("table", (8, 3), "complex128", 0, (1,), True),          # sharded along dim 0
    ]
    tensors = {f: TensorPlan(f, s, d, t, st, is_buffer=b) for f, s, d, t, st, b in specs}
    structure = {"blocks": ["layers.0", "layers.1"], "block_costs": [1, 1], "pre_cost": 0,
                 "post_cost": 0, "uses": {"w": [1], "freqs_cis": [1, 2], "table": [2]},
                 "state_dict_keys": [f for f, *_ in specs]}
    return ParallelPlan(mesh={"pp": 2, "dp": 1, "tp": tp}, zero_stage=0, schedule="1f1b",
                        microbatches=2, seed=0, tensors=tensors, aliases={}, stages=(),
                        structure=structure)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    angles = torch.outer(torch.arange(16.0), torch.rand(4, generator=g))
    return {"w": torch.randn(8, 4, generator=g),
            "freqs_cis": torch.polar(torch.ones_like(angles), angles),
            "table": torch.randn(8, 3, dtype=torch.complex128, generator=g)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).view(torch.uint8) if t.is_complex() else t.view(torch.uint8)


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(_bits(got[k]), _bits(t)), k


def test_complex_buffers_round_trip_bit_exact(tmp_path):
    plan, sd = _plan(2), _state()
    out = write_checkpoint(sd, plan, tmp_path / "ckpt")
    _same(load_full(out), sd)
    shard = load_shard(out, 1, 1, plan=plan)
    assert torch.equal(_bits(shard["table"]), _bits(sd["table"][4:]))
    assert torch.equal(_bits(shard["freqs_cis"]), _bits(sd["freqs_cis"]))
    assert torch.equal(load_tensor(out, "table", (slice(2, 6), slice(1, 3))), sd["table"][2:6, 1:3])
    with safe_open(str(out / "pp0-tp0.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["complex"]) == ["freqs_cis"]
        piece = f.get_slice("freqs_cis")
        assert (piece.get_dtype(), piece.get_shape()) == ("F32", [16, 4, 2])  # the real view
    with safe_open(str(out / "pp1-tp0.safetensors"), framework="pt") as f:
        assert f.get_slice("table").get_dtype() == "F64"


def test_reshard_export_import_keep_complex_bits(tmp_path):
    plan, sd = _plan(2), _state()
    out = write_checkpoint(sd, plan, tmp_path / "ckpt")
    reshard(out, tmp_path / "tp1", tp=1, pp=1)
    _same(load_full(tmp_path / "tp1"), sd)
    export_hf(tmp_path / "tp1", tmp_path / "hf")
    _same(load_hf_state_dict(tmp_path / "hf"), sd)
    lazy = load_hf_state_dict(tmp_path / "hf", lazy=True)
    assert lazy["freqs_cis"].shape == (16, 4) and torch.equal(lazy["freqs_cis"].read(), sd["freqs_cis"])
    import_hf(tmp_path / "hf", tmp_path / "imp", plan, tp=4, pp=2)
    _same(load_full(tmp_path / "imp"), sd)


def test_reference_file_keeps_complex_and_others_unchanged(tmp_path):
    sd = _state()
    save_tensors(sd, tmp_path / "ref.safetensors")
    _same(load_tensors(tmp_path / "ref.safetensors"), sd)
    from safetensors.torch import save_file
    save_file({"w": sd["w"]}, str(tmp_path / "plain.safetensors"))
    save_tensors({"w": sd["w"]}, tmp_path / "ours.safetensors")  # no complex: save_file's bytes
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "ours.safetensors").read_bytes()
