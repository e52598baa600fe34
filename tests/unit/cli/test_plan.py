"""``parallelize plan`` / ``check`` / ``MODEL SPEC --cluster`` through the real CLI entry
(in process; each call captures the tiny Llama example on the meta device)."""
import json

from parallelizer.cli.parallelize import main

CLUSTER = "tests/data/cluster_cpu4.yaml"
LLAMA = ["examples/llama/model.py", "examples/llama/spec.yaml"]


def test_check_exit_codes_and_compile_refusal(capsys, tmp_path, monkeypatch, tools):
    monkeypatch.chdir(tools.repo)
    # world 3 on a 4-GPU cluster is an error: exit 1, the finding names mesh and the fix
    assert main(["check", *LLAMA, "--cluster", CLUSTER, "mesh.dp=3", "mesh.tp=1"]) == 1
    out = capsys.readouterr().out
    assert "error: mesh: world size dp x tp x pp = 3 x 1 x 1 = 3" in out and "mesh.dp to 4" in out
    # warnings only (2 microbatches for pp = 2): exit 0
    assert main(["check", *LLAMA, "--cluster", CLUSTER, "mesh.dp=2", "mesh.tp=1", "mesh.pp=2",
                 "pipeline.microbatches=2", "activation_checkpointing.mode=full"]) == 0
    out = capsys.readouterr().out
    assert "warning: pipeline.microbatches" in out and "error" not in out
    # the compile runs the same check first and writes nothing on an error
    assert main([*LLAMA, "-o", str(tmp_path / "out"), "--cluster", CLUSTER, "mesh.dp=3", "mesh.tp=1"]) == 1
    assert "error: mesh: world size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_model_shape_json_and_tokens(capsys, tools):
    assert main(["plan", "--model-shape", "layers=32,hidden=4096,heads=32,vocab=51200,seq=2048",
                 "--cluster", str(tools.repo / "specs/clusters/h100-cluster.yaml"),
                 "--global-batch", "512", "--top", "3", "--json", "--tokens", "1e12"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["layouts"]) == 3 and got["fitting"] <= got["considered"]
    best = got["layouts"][0]
    assert best["tp"] * best["pp"] * best["dp"] == 256
    assert abs(best["days"] - 1e12 / best["tokens_per_s"] / 86400) < 1e-9
    assert best["tokens_per_s"] == 512 * 2048 / best["step_s"]


def test_plan_argument_errors(capsys, tools):
    assert main(["plan", "--model-shape", "layers=2", "--cluster", CLUSTER, "--global-batch", "8"]) == 2
    assert "--model-shape needs hidden, heads, vocab, seq" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(tools.repo / "nope.yaml"), "--global-batch", "8",
                 "--model-shape", "layers=2,hidden=8,heads=2,vocab=8,seq=4"]) == 2
    assert "cluster file" in capsys.readouterr().err
