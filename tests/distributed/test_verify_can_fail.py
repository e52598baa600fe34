"""``run.py --verify`` can fail: a reference with one gradient doubled and a shifted loss
must give exit 1, FAIL, and name the mismatching categories and tensor, not the others. A
checkpoint with one rank's file corrupt must stop every rank with the file named (it hung)."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

MESH = ("mesh.dp=1", "mesh.tp=2", "mesh.pp=1")  # also a case of test_equivalence: shared compile
GRAD = "model.layers.1.mlp.down_proj.weight"     # row-parallel at tp=2, not tied


def _tampered(compiled, tmp_path, edit):
    out = tmp_path / "out"
    shutil.copytree(compiled("llama", *MESH), out)
    ref = load_file(str(out / "reference.safetensors"))
    edit(ref)
    save_file(ref, str(out / "reference.safetensors"))
    return out


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *MESH)
def test_doubled_gradient_and_shifted_loss_fail(compiled, tools, tmp_path):
    # One launch for both tamperings (each category is compared on its own, so each must be
    # named; the untouched outputs and parameters must stay within tolerance).
    def edit(ref):
        ref[f"grad.{GRAD}"] = ref[f"grad.{GRAD}"] * 2
        ref["loss"] = ref["loss"] + 0.01
    res = tools.torchrun(_tampered(compiled, tmp_path, edit), 2, "--verify")
    print("\n" + res.stdout)
    assert res.code == 1, res.explain()
    assert res.stdout.rstrip().endswith("FAIL"), res.explain()
    errs = tools.verify_errors(res.stdout)
    assert abs(errs["loss"] - 0.01) < 1e-5 and errs["gradients"] > 1e-3, errs
    assert errs["outputs"] <= 1e-5 and errs["parameters"] <= 1e-5, errs
    mismatch = [line for line in res.stdout.splitlines() if line.startswith("verify: mismatches")]
    # The count is summed over ranks (every tp rank compares the gathered tensor): not checked.
    assert len(mismatch) == 1, res.stdout
    assert "loss" in mismatch[0] and "gradients" in mismatch[0] and GRAD in mismatch[0], mismatch
    assert "parameters" not in mismatch[0] and "outputs" not in mismatch[0], mismatch


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *MESH)
def test_one_corrupt_shard_stops_every_rank(compiled, tools, tmp_path):
    """Only tp rank 1 reads pp0-tp1.safetensors: it fails the sha256 check alone while rank 0
    goes on to the step's collectives. run.py used to wait in its shutdown barrier there."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(compiled("llama", *MESH) / "checkpoint", ckpt)
    bad = ckpt / "pp0-tp1.safetensors"
    data = bytearray(bad.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # tensor bytes: the header stays valid
    bad.write_bytes(bytes(data))
    res = tools.torchrun(compiled("llama", *MESH), 2, "--verify", "--load", str(ckpt), timeout=120)
    assert res.code != 0, res.explain()
    assert f"run.py: error (rank 1): checkpoint file {bad} is corrupt: sha256" in res.stderr, \
        res.explain()
    assert "copy it again or rewrite the checkpoint" in res.stderr, res.explain()
    assert "PASS" not in res.stdout, res.explain()
