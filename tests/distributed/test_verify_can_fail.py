"""``run.py --verify`` can fail: a reference with one gradient doubled, or a shifted loss,
must give exit 1, FAIL, and name the mismatching category and tensor."""
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
def test_doubled_gradient_fails(compiled, tools, tmp_path):
    def edit(ref):
        ref[f"grad.{GRAD}"] = ref[f"grad.{GRAD}"] * 2
    res = tools.torchrun(_tampered(compiled, tmp_path, edit), 2, "--verify")
    print("\n" + res.stdout)
    assert res.code == 1, res.explain()
    assert res.stdout.rstrip().endswith("FAIL"), res.explain()
    errs = tools.verify_errors(res.stdout)
    assert errs["gradients"] > 1e-3 and errs["loss"] <= 1e-5 and errs["outputs"] <= 1e-5, errs
    mismatch = [line for line in res.stdout.splitlines() if line.startswith("verify: mismatches")]
    # The count is summed over ranks (every tp rank compares the gathered tensor): not checked.
    assert len(mismatch) == 1 and mismatch[0].startswith("verify: mismatches in gradients ("), \
        res.stdout
    assert GRAD in mismatch[0] and "loss" not in mismatch[0], mismatch


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *MESH)
def test_changed_loss_fails(compiled, tools, tmp_path):
    def edit(ref):
        ref["loss"] = ref["loss"] + 0.01
    res = tools.torchrun(_tampered(compiled, tmp_path, edit), 2, "--verify")
    print("\n" + res.stdout)
    assert res.code == 1, res.explain()
    assert res.stdout.rstrip().endswith("FAIL"), res.explain()
    errs = tools.verify_errors(res.stdout)
    assert abs(errs["loss"] - 0.01) < 1e-5 and errs["gradients"] <= 1e-5, errs
    mismatch = [line for line in res.stdout.splitlines() if line.startswith("verify: mismatches")]
    assert len(mismatch) == 1 and mismatch[0].startswith("verify: mismatches in loss ("), \
        res.stdout
    assert "gradients" not in mismatch[0] and "parameters" not in mismatch[0], mismatch
