"""The planner's choice is real: ``parallelize plan -o`` writes a spec that ``parallelize
MODEL SPEC --cluster`` checks, compiles unchanged, and whose program passes ``--verify``
under torchrun (one launch, 4 gloo ranks)."""
import pytest
import yaml

from parallelizer.cli.plan import plan_main

CLUSTER = "data/cluster_cpu4.yaml"


@pytest.mark.timeout(420)
def test_planned_spec_compiles_and_verifies(tools, tmp_path):
    model, spec = tools.examples / "llama/model.py", tools.examples / "llama/spec.yaml"
    cluster = tools.repo / "tests" / CLUSTER
    planned = tmp_path / "planned.yaml"
    assert plan_main([str(model), str(spec), "--cluster", str(cluster), "--global-batch", "8",
                      "-o", str(planned)]) == 0
    chosen = yaml.safe_load(planned.read_text())
    m = chosen["mesh"]
    assert m["dp"] * m["tp"] * m["pp"] == 4
    assert m["tp"] * m["pp"] > 1, f"1.2 MB per rank must force sharding, got {m}"
    res = tools.parallelize(model, planned, tmp_path / "out", "--cluster", str(cluster),
                            "--global-batch", "8")
    assert res.code == 0, res.explain()
    assert "error:" not in res.stderr, res.stderr
    run = tools.torchrun(tmp_path / "out", 4, "--verify")
    assert "PASS" in run.stdout, run.explain()
    tools.check_exit(run)
