"""Every ZeRO stage, with and without activation checkpointing, alone (dp=4, also HSDP 2x2
and CPU offload) and with tp=2 or pp=2 (dp=2; also the zero-bubble schedules, which split
the backward into input- and weight-gradient actions, over FSDP2 with 2 stages per rank):
3 SGD steps equal to eager training of the unmodified model (last step's gradients and final
parameters, gathered to full shape, fp32);
and the memory model's parameter, gradient and optimizer bytes against the bytes each rank
measures from its local tensors after an AdamW step; and ``run_verify`` under bf16 mixed
precision. One torchrun launch (4 ranks) runs all cases through the real runtime
(zero_matrix_driver.py); a second one checks the user-facing path: ``run.py --train
--profile`` MEMORY lines against ``parallelize estimate --json``.
"""
import json
import re
from pathlib import Path

import pytest

from parallelizer.cli import parallelize as cli

TOL = 1e-5          # fp32, absolute
MEMORY_TOL = 0.05   # the bound; the bookkeeping is exact on these programs
# The driver trains with its own SGD (lr 0.1), whatever the spec's optimizer, so the first
# program is test_equivalence's gpt-dp2-tp2 (one compile for both in a full run).
PROGRAMS = {  # out name prefix -> (example, overrides)
    "gpt-dp2-tp2": ("gpt", ("mesh.dp=2", "mesh.tp=2", "mesh.pp=1")),
    "llama-dp2-pp2": ("llama", ("mesh.dp=2", "mesh.tp=1", "mesh.pp=2")),
    # pipeline.microbatches accumulates at pp = 1 too: the 8-row batch is 2 rows per dp rank
    "llama-dp4": ("llama", ("mesh.dp=4", "mesh.tp=1", "mesh.pp=1", "pipeline.microbatches=2")),
    # V placement, 2 stages per rank (embedding and LM head on rank 0), for the zero-bubble
    # schedules; compiled for dp=1 (test_schedules_equivalence.py's PP2_V2: one compile for both), the
    # driver runs it at dp=2 (the checkpoint is per stage and tp; dp replicas share it)
    "llama-pp2-zbv": ("llama", ("mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "optimizer.name=sgd",
                                "optimizer.lr=0.1", "optimizer.weight_decay=0.0",
                                "pipeline.schedule=zbv", "pipeline.virtual_stages=2")),
}
DRIVER = Path(__file__).with_name("zero_matrix_driver.py")
PROFILE = ("gpt", ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1"))  # test_equivalence's gpt-dp2 program


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def _assert_close(measured: dict, estimated: dict, where: str) -> None:
    for key in ("parameters", "gradients", "optimizer"):
        m, e = measured[key], estimated[key]
        assert m > 0 or key == "optimizer", (where, key, m)
        assert abs(m - e) <= MEMORY_TOL * m, f"{where} {key}: measured {m}, estimated {e}"


@pytest.mark.timeout(300)
@pytest.mark.precompile(PROGRAMS["gpt-dp2-tp2"][0], *PROGRAMS["gpt-dp2-tp2"][1])
@pytest.mark.precompile(PROGRAMS["llama-dp2-pp2"][0], *PROGRAMS["llama-dp2-pp2"][1])
@pytest.mark.precompile(PROGRAMS["llama-dp4"][0], *PROGRAMS["llama-dp4"][1])
@pytest.mark.precompile(PROGRAMS["llama-pp2-zbv"][0], *PROGRAMS["llama-pp2-zbv"][1])
def test_zero_stages_train_like_eager_and_match_the_memory_model(compiled, tools, tmp_path):
    outs = [compiled(example, *ov) for example, ov in PROGRAMS.values()]
    p = tools.launch(DRIVER, 4, *outs, cwd=tmp_path, timeout=280).wait()
    results = _results(p.stdout)
    explain = p.explain()
    train = [r for r in results if r["kind"] == "train"]
    memory = [r for r in results if r["kind"] == "memory"]
    verify = [r for r in results if r["kind"] == "verify"]
    assert len(train) == 16 and len(memory) == 7 and len(verify) == 1, explain
    seen_pairs = set()
    for r in train:
        where = (f"{r['out']} {r['schedule']} zero_stage {r['zero_stage']} ac {r['ac']} "
                 f"hsdp {r['dp_replicate']} offload {r['offload']}")
        print(f"\n{where}: grads err {r['err']['gradients']:.3g}, params err "
              f"{r['err']['parameters']:.3g} ({r['counts']['parameters']} tensors)", end="")
        assert r["err"]["gradients"] <= TOL and r["err"]["parameters"] <= TOL, where
        assert r["counts"]["gradients"] > 0 and r["moved"] > 100 * TOL, where
        seen_pairs.add((r["zero_stage"], r["ac"] != "none"))
    assert seen_pairs == {(z, ac) for z in range(4) for ac in (False, True)}
    # zero-bubble schedules (split input/weight gradients) over FSDP2, 2 stages per rank
    zero_bubble = {(r["schedule"], r["zero_stage"]) for r in train
                   if r["schedule"] in ("zbv", "dualpipev", "interleaved_zero_bubble")}
    assert zero_bubble == {("zbv", 3), ("dualpipev", 3), ("interleaved_zero_bubble", 2)}, zero_bubble
    # explicit prefetch lists (forward, backward) per block of the 4-block llama: depth 1
    # by default, depth 3 on the HSDP case; never past the stage's ends
    hsdp = next(r for r in train if r["dp_replicate"] == 2)
    assert hsdp["prefetch"] == [[3, 0], [2, 1], [1, 2], [0, 3]], hsdp["prefetch"]
    plain = next(r for r in train if r["out"].startswith("llama") and r["zero_stage"] == 2
                 and r["dp_replicate"] == 1 and r["mesh"]["pp"] == 1)
    assert plain["prefetch"] == [[1, 0], [1, 1], [1, 1], [0, 1]], plain["prefetch"]
    for r in memory:
        assert len(r["ranks"]) == 4
        for row in r["ranks"]:
            _assert_close(row["measured"], row["estimated"],
                          f"{r['out']} zero_stage {r['zero_stage']} rank {row['measured']['rank']}")
    assert sorted(r["zero_stage"] for r in memory if r["virtual_stages"] == 1) == [0, 1, 2, 3, 3]
    # 2 stages per rank (issue 12: the estimate once counted one stage per rank): exact, on
    # every rank, under V placement (zbv) and loop placement (interleaved_1f1b)
    virtual = {r["schedule"]: r["ranks"] for r in memory if r["virtual_stages"] == 2}
    assert sorted(virtual) == ["interleaved_1f1b", "zbv"], explain
    for schedule, rows in virtual.items():
        for row in rows:
            m, e = row["measured"], row["estimated"]
            print(f"\nv=2 {schedule} rank {m['rank']}: measured {m}, estimated {e}", end="")
            assert [m[k] for k in ("parameters", "gradients", "optimizer", "buffers")] == \
                [e[k] for k in ("parameters", "gradients", "optimizer", "buffers")], (schedule, m, e)
    # ZeRO's sharding shows in the measurement itself: stage 3 holds 1/dp_shard of stage 0
    by_stage = {(r["zero_stage"], r["dp_replicate"]): r["ranks"] for r in memory
                if r["virtual_stages"] == 1}
    p0, p3 = by_stage[(0, 1)][0]["measured"], by_stage[(3, 1)][0]["measured"]
    assert abs(p3["parameters"] * 2 - p0["parameters"]) <= 0.05 * p0["parameters"], (p0, p3)
    assert p0["optimizer"] > by_stage[(1, 1)][0]["measured"]["optimizer"], "ZeRO-1 did not partition"
    # bf16 mixed precision (zero_stage 2, tp=2): run_verify's tolerances by dtype, and it says so
    assert ("param_dtype bf16, reduce_dtype fp32, atol=0.03 rtol=0.03 (tolerances for bf16)"
            in p.stdout), explain
    errs = tools.verify_errors(p.stdout)
    print("\nbf16 zero_stage 2 dp=2 tp=2 verify: " + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()), end="")
    assert verify[0]["code"] == 0, explain
    assert errs["loss"] > 1e-4 and errs["gradients"] > 1e-5, f"not computed in bf16? {errs}"
    assert p.code == 0, explain


@pytest.mark.timeout(300)
@pytest.mark.precompile(PROFILE[0], *PROFILE[1])
def test_profile_memory_lines_match_estimate_json(compiled, tools, capsys):
    example, overrides = PROFILE
    out = compiled(example, *overrides)
    res = tools.torchrun(out, 2, "--train", "--steps", "1", "--profile")
    # anywhere in a line: rank 0's ``step 1 loss`` print writes its newline separately, so
    # another rank's MEMORY line can land right after the loss (seen under load)
    lines = [json.loads(m) for m in re.findall(r"MEMORY (\{.*?\})$", res.stdout, re.MULTILINE)]
    capsys.readouterr()
    code = cli.main(["estimate", str(tools.examples / example / "model.py"),  # in-process: no
                     str(tools.examples / example / "spec.yaml"), *overrides, "--json"])  # 2nd torch import
    est = capsys.readouterr()
    assert code == 0, est.err
    ranks = {r["rank"]: r for r in json.loads(est.out)["ranks"]}
    assert sorted(l["rank"] for l in lines) == [0, 1], res.explain()
    for line in lines:
        print(f"\nrank {line['rank']}: measured {line}, estimated {ranks[line['rank']]}", end="")
        _assert_close(line, ranks[line["rank"]], f"rank {line['rank']}")
        assert line["optimizer"] > 0 and line["peak"] > line["parameters"], line
        assert line["peak_kind"] == "process_peak_rss"
    tools.check_exit(res)
