"""Every pipeline schedule of the installed torch equals the unmodified model.

Each test compiles an example once and runs ``schedules_entry.py`` under torchrun: one
process group, several schedules in turn, each a full ``--verify`` (loss, outputs, gradients
gathered to full shape, parameters after one SGD step vs. reference.safetensors, fp32,
atol = rtol = 1e-5). Llama has tied embeddings: under zbv / dualpipev the embedding (stage 0)
and the LM head (stage 3) sit on one rank, under the others on two.
"""
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from parallelizer.plan.schedules import bubble
from parallelizer.runtime.main import _main as run_main

TOL = 1e-5
TOL_OVERRIDE = {("minilm", "outputs"): 5e-5}  # see test_equivalence.py
ENTRY = Path(__file__).with_name("schedules_entry.py")
_SCHEDULE = re.compile(r"^SCHEDULE (\S+) (\d+)$")

MULTI = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
# at pp=2 interleaved_zero_bubble runs in the minilm test below, and zbv, dualpipev and
# interleaved_zero_bubble train like eager in test_zero_matrix.py; pp4 v2 runs all of MULTI
MULTI_PP2 = ("interleaved_1f1b", "looped_bfs", "dualpipev")
# test_zero_matrix.py's llama-pp2-zbv compiles the same (one compile for both); the
# llama spec has 4 microbatches; --verify's SGD step runs at optimizer.lr = 0.1
PP2_V2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "optimizer.name=sgd", "optimizer.lr=0.1",
          "optimizer.weight_decay=0.0", "pipeline.schedule=zbv", "pipeline.virtual_stages=2")
PP2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2")  # test_equivalence.py compiles the same
PP4 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=4")
# 8 stages of a 4-layer Llama: every layer cut inside (attention | MLP); 8 microbatches, as
# dualpipev needs microbatches >= stages
PP4_V2 = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=4", "optimizer.name=sgd", "optimizer.lr=0.1",
          "optimizer.weight_decay=0.0", "pipeline.schedule=interleaved_1f1b",
          "pipeline.virtual_stages=2", "pipeline.microbatches=8")


def _run(tools, out: Path, nproc: int, *args: str):
    """torchrun schedules_entry.py, as conftest's torchrun launches OUT/run.py."""
    return tools.launch(ENTRY, nproc, out, *args, timeout=280).wait()


def _explain(p) -> str:
    return p.explain()


def _per_schedule(tools, stdout: str) -> dict:
    """schedule -> (exit code, {category: max abs err}) from the entry's output."""
    out, block = {}, []
    for line in stdout.splitlines():
        m = _SCHEDULE.match(line)
        if m:
            out[m.group(1)] = (int(m.group(2)), tools.verify_errors("\n".join(block)))
            block = []
        else:
            block.append(line)
    return out


def _check(tools, example, p, schedules):
    results = _per_schedule(tools, p.stdout)
    for name, (code, errs) in results.items():
        print(f"\n{example} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()), end="")
    assert list(results) == list(schedules), _explain(p)
    for name, (code, errs) in results.items():
        assert code == 0, (name, _explain(p))
        assert set(errs) == {"loss", "outputs", "gradients", "parameters"}, _explain(p)
        for cat, err in errs.items():
            assert err <= TOL_OVERRIDE.get((example, cat), TOL), (name, cat, err)
    assert p.code == 0, _explain(p)


def _bubbles(stdout: str) -> list[dict]:
    return [json.loads(line[len("BUBBLE "):]) for line in stdout.splitlines()
            if line.startswith("BUBBLE ")]


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *PP2_V2)
def test_multi_stage_schedules_pp2_v2_with_measured_bubble(compiled, tools, capsys):
    out = compiled("llama", *PP2_V2)
    plan = json.loads((out / "plan.json").read_text())
    assert [s["rank"] for s in plan["stages"]] == [0, 1, 1, 0]  # V placement
    assert sorted(p.name for p in (out / "checkpoint").glob("*.safetensors")) == \
        [f"pp{s}-tp0.safetensors" for s in range(4)]
    p = _run(tools, out, 2, "--profile", *MULTI_PP2)
    _check(tools, "llama", p, MULTI_PP2)
    bubbles = _bubbles(p.stdout)
    assert sorted((b["schedule"], b["rank"]) for b in bubbles) == \
        sorted((s, r) for s in MULTI_PP2 for r in (0, 1)), p.stdout
    for b in bubbles:
        assert 0.0 <= b["measured"] < 1.0 and len(b["measured_steps"]) == 5, b
        assert b["theoretical"] == (None if bubble(b["schedule"], 2, 4, 2, upper_bound=False) is None
                                    else round(bubble(b["schedule"], 2, 4, 2, upper_bound=False), 4)), b
        want = {"zbv": [[0, 3], [1, 2]], "dualpipev": [[0, 3], [1, 2]]}.get(
            b["schedule"], [[0, 2], [1, 3]])
        assert b["stages"] == want[b["rank"]], b
    assert {b["theoretical"] for b in bubbles if b["schedule"] == "interleaved_1f1b"} == {0.1111}

    # run.py --schedule with a schedule the stages cannot run: one line, exit 2, before any
    # process group (run.py's own entry, in process: a python start costs seconds on CI)
    capsys.readouterr()
    assert run_main(out, ["--verify", "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not dist.is_initialized(), err
    assert ("run.py: error: this program (mesh.pp 2, pipeline.virtual_stages 2, pipeline.microbatches "
            "4) cannot run schedule '1f1b': pipeline.schedule '1f1b' runs one stage per rank but "
            "pipeline.virtual_stages is 2") in err, err


@pytest.mark.timeout(300)
@pytest.mark.precompile("minilm", *PP2)
def test_single_stage_schedules_pp2_keyword_inputs_and_bad_batch(compiled, tools):
    """MiniLM: input_ids, attention_mask, token_type_ids as keyword inputs, a
    BaseModelOutputWithPooling output; 1f1b is test_equivalence.py's minilm-pp2."""
    out = compiled("minilm", *PP2)
    schedules = ("gpipe", "interleaved_zero_bubble")
    p = _run(tools, out, 2, "--bad-batch", *schedules)
    _check(tools, "minilm", p, schedules)
    errors = [line for line in p.stdout.splitlines() if line.startswith("BATCHERROR ")]
    assert len(errors) == len(schedules), p.stdout
    assert "batch size 3 is not divisible by pipeline.microbatches (2)" in errors[0], errors


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *PP4)
@pytest.mark.precompile("llama", *PP4_V2)
def test_schedules_pp4_and_pp4_v2_cut_inside_blocks(compiled, tools):
    """One launch on 4 ranks: gpipe and 1f1b on one stage per rank, then every multi-stage
    schedule on 8 stages, which a 4-layer Llama only has when each layer is cut between its
    attention and its MLP (planning/pipeline.py, cuts inside a block)."""
    out, out_v2 = compiled("llama", *PP4), compiled("llama", *PP4_V2)
    summary = json.loads((out_v2 / "pipeline.json").read_text())
    layers = [f"model.layers.{i}" for i in range(4)]
    assert [st["blocks"] for st in summary["stages"]] == [[b] for b in layers for _ in (0, 1)]
    assert [st["children"] for st in summary["stages"]] == [
        {b: [f"{b}.{c}" for c in part]} for b in layers
        for part in (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))]
    plan = json.loads((out_v2 / "plan.json").read_text())
    assert [s["blocks"] for s in plan["stages"]] == [[b] for b in layers for _ in (0, 1)]
    report = (out_v2 / "report.md").read_text()
    assert "| 1 | model.layers.0 (post_attention_layernorm, mlp) |" in report, report
    single = ("gpipe", "1f1b")
    p = _run(tools, out, 4, *single, "--program", str(out_v2), *MULTI)
    _check(tools, "llama", p, single + MULTI)
