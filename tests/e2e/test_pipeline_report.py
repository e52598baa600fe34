"""The pipeline split end to end: ``parallelize inspect --json --plots`` (the CLI entry,
in process; split_points naming a child cut a block), the microbatch check, report.md and the PNGs in OUT/, and a last stage holding
only the final norm and the LM head (``pipeline.layers_per_stage=[4,0]``) running
``--verify`` against the single-device reference (torchrun, gloo, fp32).
"""
import contextlib
import io
import json
import struct

import pytest

from parallelizer.cli import parallelize as cli

HEAD_ALONE = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "pipeline.layers_per_stage=[4,0]")
TOL = 1e-5


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def inspect(tools, capsys, *args):
    code = cli.main(["inspect", str(tools.examples / "llama" / "model.py"),
                     str(tools.examples / "llama" / "spec.yaml"), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def inspected(tools, tmp_path_factory):
    plots = tmp_path_factory.mktemp("plots")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["inspect", str(tools.examples / "llama" / "model.py"),
                         str(tools.examples / "llama" / "spec.yaml"), "mesh.tp=1", "mesh.pp=4",
                         "pipeline.split_points=[model.layers.1,model.layers.2.mlp,model.layers.3]",
                         "--json", "--plots", str(plots)])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue()), err.getvalue(), plots


def test_inspect_json_shape(inspected):
    summary, _, _ = inspected
    stages = summary["stages"]
    assert [s["index"] for s in stages] == [0, 1, 2, 3]
    for s in stages:
        assert {"index", "flops", "param_bytes", "fqns"} <= set(s)
        assert s["flops"] == s["fwd_flops"] + s["bwd_flops"] > 0 and s["param_bytes"] > 0
    # stage 2 begins at a child: model.layers.2 is cut, its mlp in stage 2, the rest in 1
    assert summary["split"] == "pipeline.split_points"
    assert [s["blocks"] for s in stages] == [["model.layers.0"], ["model.layers.1", "model.layers.2"],
                                             ["model.layers.2"], ["model.layers.3"]]
    kids = ["input_layernorm", "self_attn", "post_attention_layernorm"]
    assert [s["children"] for s in stages] == [
        {}, {"model.layers.2": [f"model.layers.2.{c}" for c in kids]},
        {"model.layers.2": ["model.layers.2.mlp"]}, {}]
    assert "model.layers.2.self_attn.q_proj.weight" in stages[1]["fqns"]
    assert {f for f in stages[2]["fqns"]} == {f"model.layers.2.mlp.{p}_proj.weight"
                                               for p in ("gate", "up", "down")}
    # the tied embedding is held by the first and the last stage, under its canonical name
    assert "model.embed_tokens.weight" in stages[0]["fqns"] and "model.embed_tokens.weight" in stages[3]["fqns"]
    mean = sum(s["flops"] for s in stages) / 4
    assert summary["imbalance"] == pytest.approx(max(s["flops"] for s in stages) / mean)
    assert summary["bubble"] == pytest.approx(3 / 7)               # (P-1)/(M+P-1), M=4
    assert [s["activation_bytes_sent"] > 0 for s in stages] == [True, True, True, False]
    # what a stage sends, by module and shape per rank: the residual stream of the last block
    # it holds; from inside the cut block both the residual and the normed value the mlp
    # reads; the last stage returns the outputs
    assert [s["sends"] for s in stages] == [
        ["model.layers.0: (batch, seq, 64) float32"],
        ["model.layers.2.post_attention_layernorm: (batch, seq, 64) float32 (x2)"],
        ["model.layers.2: (batch, seq, 64) float32"], []], [s["sends"] for s in stages]


def test_inspect_warns_and_draws(inspected):
    summary, stderr, plots = inspected
    assert ("warning: pipeline.microbatches (4) < 2 x mesh.pp = 8: the pipeline bubble is 43% of "
            "the step (1f1b)") in stderr
    assert sorted(p.name for p in plots.iterdir()) == ["pipeline_costs.png", "pipeline_schedule.png"]
    w, h = png_size(plots / "pipeline_schedule.png")
    assert w > 300 and h > 100
    assert min(png_size(plots / "pipeline_costs.png")) > 100


def test_too_few_microbatches_is_an_error(tools, capsys):
    code, out, err = inspect(tools, capsys, "mesh.pp=4", "pipeline.schedule=gpipe",
                             "pipeline.microbatches=2")
    assert code == 2 and out == ""
    assert err.startswith("error: pipeline.microbatches (2) must be >= mesh.pp (4)")


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *HEAD_ALONE)
def test_head_alone_stage_verifies(compiled, tools):
    out = compiled("llama", *HEAD_ALONE)
    report = (out / "report.md").read_text()
    assert "split: fixed by pipeline.layers_per_stage" in report
    assert "| 1 | - |" in report                                   # stage 1 holds no block
    assert "![schedule](pipeline_schedule.png)" in report
    summary = json.loads((out / "pipeline.json").read_text())
    assert summary["stages"][1]["blocks"] == []
    assert set(summary["stages"][1]["fqns"]) == {"model.norm.weight", "model.embed_tokens.weight"}
    png_size(out / "pipeline_costs.png")
    png_size(out / "pipeline_schedule.png")
    res = tools.torchrun(out, 2, "--verify")
    errs = tools.verify_errors(res.stdout)
    assert res.stdout.rstrip().endswith("PASS"), res.explain()
    assert set(errs) == {"loss", "outputs", "gradients", "parameters"}, res.explain()
    assert all(e <= TOL for e in errs.values()), errs
    tools.check_exit(res)
