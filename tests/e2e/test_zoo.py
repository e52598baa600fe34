"""Smoke test of the held-out zoo (benchmarks/zoo): its model.py files follow the README's
contract and capture on the meta device (three families: a Hugging Face decoder, torchtitan's
Llama with its complex rotary buffer, timm's ViT), its layouts are valid specs, and the
runner classifies recorded compile and verify outputs as it should. The zoo itself (every
family compiled and verified at tp2, pp2, tp2 x pp2) is a benchmark: ``python -m
benchmarks.zoo`` (benchmarks/zoo/README.md)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.zoo import classify
from benchmarks.zoo.families import FAMILIES
from benchmarks.zoo.family import KINDS
from benchmarks.zoo.runner import LAYOUTS, counts, table

REPO = Path(__file__).resolve().parents[2]


def test_every_family_is_a_model_file_of_the_contract():
    hf = [f for f in FAMILIES.values() if f.kind != "external"]
    assert len(hf) >= 30 and {"nanogpt", "titan_llama", "cast_linear"} <= set(FAMILIES)
    assert {f.kind for f in FAMILIES.values()} == set(KINDS)
    for fam in FAMILIES.values():
        tree = ast.parse(fam.source, filename=f"{fam.name}/model.py")
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"build_model", "example_inputs"} <= defined, fam.name
        assert "manual_seed(0)" in fam.source, fam.name  # seeded
        if fam.kind != "external":
            if fam.kind in ("decoder", "encoder-decoder", "moe", "hybrid"):
                assert "use_cache=False" in fam.source, fam.name
            assert "dropout" not in fam.source.split("def build_model")[1].split("return")[0], \
                f"{fam.name}: the zoo keeps each config's dropout"


@pytest.mark.parametrize("name", ["qwen3", "titan_llama", "timm_vit"])
def test_family_captures_on_meta(name, tmp_path):
    from parallelizer.frontend.capture import capture
    from parallelizer.frontend.model_file import load_model
    path = FAMILIES[name].write(tmp_path)
    loaded = load_model(path, on_meta=True)
    assert all(p.is_meta for p in loaded.model.parameters())
    batch = loaded.batch
    batch = ({k: v.to("meta") for k, v in batch.items()} if isinstance(batch, dict)
             else tuple(v.to("meta") for v in batch))
    captured = capture(loaded.model, batch, path)
    assert captured.route == "torch.export"
    if name == "titan_llama":  # the complex rotary table is in the graph, as the issue has it
        assert loaded.model.freqs_cis.dtype == torch.complex64
        assert any("view_as_complex" in str(n.target) for n in captured.gm.graph.nodes)


def test_sdpa_where_the_family_has_it():
    import transformers
    for name in ("qwen3", "gpt_bigcode", "mpt", "xglm"):
        src = FAMILIES[name].source
        cls = getattr(transformers, src.split("return T.")[1].split("(")[0])
        assert ("attn_implementation='sdpa'" in src) == bool(cls._supports_sdpa), name


def test_layouts_are_valid_specs(tmp_path):
    from parallelizer.frontend.spec import load_spec
    for lay in LAYOUTS.values():
        path = tmp_path / f"{lay.name}.yaml"
        path.write_text(lay.spec())
        spec = load_spec(path)
        assert (spec.mesh.tp, spec.mesh.pp, spec.mesh.dp, spec.zero_stage) == (lay.tp, lay.pp, 1, 3)
        assert spec.pipeline.microbatches >= lay.pp


# Outputs recorded from the baseline run (trimmed), one per outcome.
PASS_OUT = """verify: mesh pp=2 x dp=1 x tp=1, fp32, atol=1e-05 rtol=1e-05 (tolerances for fp32)
verify: loss 4.574088 (reference 4.574088) max abs err 9.54e-07
verify: outputs max abs err 9.54e-07
verify: gradients (gathered to full shape) max abs err 1.49e-08
verify: parameters after one sgd step max abs err 1.86e-09
PASS
"""
FAIL_OUT = """verify: mesh pp=1 x dp=1 x tp=2, fp32, atol=1e-05 rtol=1e-05 (tolerances for fp32)
verify: loss 4.574088 (reference 4.574088) max abs err 4.77e-07
verify: outputs max abs err 4.77e-07
verify: gradients (gathered to full shape) max abs err 0.0019
verify: parameters after one sgd step max abs err 1.91e-06
verify: mismatches in gradients (8 mismatched; worst on rank 0: model.layers.1.self_attn.q_norm.weight)
FAIL

E1201 23:36:17.245000 32297 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "/work/venv/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""
CRASH_COMPILE = """Traceback (most recent call last):
  File "/work/wt/parallelizer/compiler.py", line 74, in compile_to_dir
    program.save(Path(out_dir))
  File "/work/wt/parallelizer/checkpoint/stream.py", line 56, in write_streamed
    header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                             ~~~~~~~~~^^^^^^^
KeyError: torch.complex64
"""
INTERNAL = """Traceback (most recent call last):
  File "/work/wt/parallelizer/passes/split_check.py", line 46, in check_split
    raise SplitMismatch(
parallelizer.passes.split_check.SplitMismatch: internal error: stage 0 after split_stages reads []
"""
REFUSED_ERR = ("some warning\nerror: mesh.tp=2: nothing in the blocks could be sharded: "
               "aten.conv1d at modeling_mamba.py:312 has no sharding rule; set "
               "tensor_parallel.allow_replicated: true\n")
RUN_CRASH = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/x/out/program/stage0.py", line 88, in forward
[rank1]:     add_ = x.add_(y)
[rank1]: RuntimeError: Output 0 of ReduceScatterBackward is a view and is being modified inplace.
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/x/out/program/stage0.py", line 88, in forward
[rank0]:     add_ = x.add_(y)
[rank0]: RuntimeError: Output 0 of ReduceScatterBackward is a view and is being modified inplace.
"""


def test_classify_compile_outcomes():
    ok = classify.classify_compile(0, "tensor parallel: 14 of 14 weight matrices in blocks sharded "
                                      "(99 % of parameters)\n", "")
    assert ok["status"] is None and ok["tp"]["sharded"] == ok["tp"]["total"] == 14
    flat = classify.classify_compile(0, "tensor parallel: no repeated blocks found; 6 of 7 weight "
                                        "matrices in the model sharded (99.8 % of parameters)\n", "")
    assert (flat["tp"]["sharded"], flat["tp"]["total"]) == (6, 7)
    out = classify.classify_compile(0, "tensor parallel: 4 of 4 weight matrices in blocks sharded; "
                                       "0 of 10 outside them (6 % of parameters)\n", "")
    assert (out["tp"]["outside_sharded"], out["tp"]["outside_total"]) == (0, 10)
    assert ok["tp"]["outside_total"] == 0
    crash = classify.classify_compile(1, "", CRASH_COMPILE)
    assert crash["status"] == "COMPILE-CRASH" and crash["error"] == "KeyError: torch.complex64"
    assert crash["frames"][-1] == "checkpoint/stream.py:56 in write_streamed"
    internal = classify.classify_compile(1, "", INTERNAL)
    assert internal["status"] == "COMPILE-CRASH" and "SplitMismatch: internal error" in internal["error"]
    # an `error:` line in internal-error wording is a crash, not a refusal
    assert classify.classify_compile(2, "", "error: internal error: x\n")["status"] == "COMPILE-CRASH"
    refused = classify.classify_compile(2, "", REFUSED_ERR)
    assert refused["status"] == "REFUSED" and refused["source_line"] == "modeling_mamba.py:312"
    assert refused["error"].startswith("mesh.tp=2: nothing in the blocks")
    assert classify.classify_compile(None, "", "", timed_out=True)["status"] == "TIMEOUT"


def test_classify_run_outcomes():
    ok = classify.classify_run(0, PASS_OUT)
    assert ok["status"] == "PASS" and ok["figures"]["gradients"] == 1.49e-08
    fail = classify.classify_run(1, FAIL_OUT)
    assert fail["status"] == "FAIL"
    assert fail["categories"] == {"gradients": (8, "model.layers.1.self_attn.q_norm.weight")}
    assert fail["figures"]["gradients"] == 0.0019 and "q_norm.weight" in fail["error"]
    crash = classify.classify_run(1, RUN_CRASH)
    assert crash["status"] == "RUN-CRASH"
    assert crash["error"].startswith("RuntimeError: Output 0 of ReduceScatterBackward is a view")
    assert crash["frames"] == ["program/stage0.py:88 in forward"]
    assert classify.classify_run(1, "exit without verdict")["status"] == "RUN-CRASH"
    assert classify.classify_run(None, "", timed_out=True)["status"] == "TIMEOUT"


def test_table_and_counts():
    tp = {"sharded": 8, "total": 14, "line": ""}
    recs = [{"family": "qwen3", "layout": "tp2", "status": "PASS", "compile": {"tp": tp}},
            {"family": "qwen3", "layout": "pp2", "status": "REFUSED",
             "compile": {"tp": None, "source_line": "modeling_qwen3.py:1"}},
            {"family": "mamba", "layout": "tp2", "status": "FAIL", "compile": {"tp": tp},
             "run": {"categories": {"gradients": (1, "w")}}}]
    t = table(recs, ["tp2", "pp2"])
    assert "| qwen3 | decoder | PASS 8/14 | REFUSED (line) |" in t
    assert "| mamba | hybrid | FAIL grad 8/14 |  |" in t
    c = counts(recs, ["tp2", "pp2"])
    assert "| PASS | 1 | 0 | 1 |" in c and "| REFUSED | 0 | 1 | 1 |" in c


def test_cli_lists_and_refuses_unknown_names():
    run = [sys.executable, "-m", "benchmarks.zoo"]
    listed = subprocess.run(run + ["--list"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == len(FAMILIES)
    bad = subprocess.run(run + ["--families", "nope"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown families ['nope']" in bad.stderr


def test_sweep_derives_tiny_configs_through_each_config_s_own_names():
    """benchmarks/zoo/sweep.py: the standard sizes reach a config through its attribute_map
    (GPT-2's n_embd), its own names by pattern (T5's d_ff, d_kv), sub-configs as dicts with
    the cache off (T5Gemma's encoder / decoder); the zoo's and the tests' types are left out."""
    import transformers as T
    from benchmarks.zoo import sweep
    gpt2 = T.GPT2Config(**sweep.tiny_kwargs(T.GPT2Config, "decoder"))
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size) == (32, 2, 4, 96)
    t5 = T.T5Config(**sweep.tiny_kwargs(T.T5Config, "encoder-decoder"))
    assert (t5.d_model, t5.d_ff, t5.d_kv, t5.num_layers, t5.num_heads) == (32, 64, 8, 2, 4)
    kw = sweep.tiny_kwargs(T.T5GemmaConfig, "encoder-decoder")
    assert kw["encoder"]["hidden_size"] == 32 and kw["encoder"]["use_cache"] is False
    types = {t for t, *_ in sweep.candidates()}
    assert not types & sweep.covered_types() and {"gpt2", "qwen3", "t5"} <= sweep.covered_types()
