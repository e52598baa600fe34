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


SHAPE = "layers=8,hidden=1024,heads=16,vocab=32000,seq=2048,ffn=2816,glu=1"
H200 = "specs/clusters/h200-node.yaml"


def test_plan_explain_attention_and_figures_are_printed(capsys, tools):
    cluster = str(tools.repo / H200)
    assert main(["plan", "--model-shape", SHAPE, "--cluster", cluster, "--global-batch", "16",
                 "--top", "2", "--explain", "2"]) == 0
    out = capsys.readouterr().out
    # where the figures come from and which attention was assumed, with the answer
    assert "figures: datasheet: h200" in out and "fused (flash / SDPA) attention" in out
    explain = out[out.index("explain #2 "):]
    step = float(explain.split("step ", 1)[1].split(" ", 1)[0])
    assert "compute " in explain and "compute by kind" in explain and "matmul" in explain
    assert "collectives (per step on this rank" in explain and "(cluster links)" in explain
    assert f"#2 {explain.split()[2]}" in out                     # the layout it explains is #2
    assert step > 0 and "-0." not in explain                     # no negative parts printed
    assert main(["plan", "--model-shape", SHAPE, "--cluster", cluster, "--global-batch", "16",
                 "--attention", "eager", "--json", "--top", "1", "--fix", "tp=1,pp=1,dp=8"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model-shape", SHAPE, "--cluster", cluster, "--global-batch", "16",
                 "--json", "--top", "1", "--fix", "tp=1,pp=1,dp=8"]) == 0
    flash = json.loads(capsys.readouterr().out)
    assert flash["attention"] == "flash" and eager["attention"] == "eager"
    assert "eager attention" in eager["figures"]
    # the stored scores (Korthikanti's 5 a s / h per token and block) only under eager
    assert eager["layouts"][0]["memory_parts_gb"]["activations"] > 2 * flash["layouts"][0]["memory_parts_gb"]["activations"]
    b = flash["layouts"][0]["breakdown"]
    assert sum(b["terms"].values()) == flash["layouts"][0]["step_s"] or \
        abs(sum(b["terms"].values()) / flash["layouts"][0]["step_s"] - 1) < 1e-9
    assert flash["calibrated"] is None and b["sources"]["compute"] == "datasheet"


def test_plan_proposes_only_what_the_runtime_executes(capsys, tools):
    # bf16 runs under FSDP2 only (ZeRO 2/3); run.py has no gradient accumulation, so at pp = 1
    # a step is one microbatch
    assert main(["plan", "--model-shape", SHAPE, "--cluster", str(tools.repo / H200),
                 "--global-batch", "64", "--top", "500", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert len(rows) > 20
    assert all(r["zero_stage"] in (2, 3) for r in rows)
    assert all(r["microbatches"] == 1 for r in rows if r["pp"] == 1)
    assert all(r["micro_batch"] * r["microbatches"] * r["dp"] == 64 for r in rows)


def test_plan_attention_option_is_for_shapes_only(capsys):
    assert main(["plan", *LLAMA, "--cluster", CLUSTER, "--global-batch", "8", "--attention", "eager"]) == 2
    err = capsys.readouterr().err
    assert "--attention eager goes with --model-shape" in err and "drop --attention" in err


def test_plan_non_dividing_batch_names_the_nearest(capsys, tools, tmp_path):
    # 3 nodes x 8: tp=1, pp=1 makes dp = 24, which does not divide 1000 sequences
    path = tmp_path / "three.yaml"
    path.write_text("nodes: 3\ngpus_per_node: 8\ngpu: h200\ndtype: bf16\n"
                    "inter_node: {bandwidth_gb_s: 50, latency_us: 5}\n")
    assert main(["plan", "--model-shape", SHAPE, "--cluster", str(path), "--global-batch", "1000",
                 "--fix", "tp=1,pp=1"]) == 2
    err = capsys.readouterr().err
    assert "no layout has tp=1,pp=1 for --global-batch 1000 on 24 GPUs" in err
    assert "the nearest global batches that do: 984 or 1008" in err


def test_one_node_cluster_needs_no_network_section(capsys, tools, tmp_path):
    one = tmp_path / "one-node.yaml"
    one.write_text("nodes: 1\ngpus_per_node: 4\ngpu: a100-80gb\ndtype: bf16\n")
    assert main(["plan", "--model-shape", SHAPE, "--cluster", str(one), "--global-batch", "8",
                 "--top", "1"]) == 0
    assert "4 x a100-80gb" in capsys.readouterr().out
    # a GPU given by numbers, alone on its node, needs no link figures either
    single = tmp_path / "single.yaml"
    single.write_text("nodes: 1\ngpus_per_node: 1\ndtype: fp32\ngpu: {name: mine, memory_gb: 80, "
                      "memory_bandwidth_gb_s: 2000, tflops: {bf16: 300, fp16: 300, fp32: 60}}\n")
    assert main(["plan", "--model-shape", SHAPE, "--cluster", str(single), "--global-batch", "2",
                 "--top", "1"]) == 0
    assert "tp=1 pp=1 dp=1" in capsys.readouterr().out


def test_plan_model_file_explain(capsys, tools, monkeypatch):
    monkeypatch.chdir(tools.repo)
    assert main(["plan", *LLAMA, "--cluster", CLUSTER, "--global-batch", "8", "--top", "3",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "attention as the model file's graph runs it" in out
    explain = out[out.index("explain #1 "):]
    assert "compute by kind" in explain and "collectives" in explain
