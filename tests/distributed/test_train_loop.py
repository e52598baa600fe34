"""run.py --train beyond one step: the LR schedule, gradient accumulation and token data
(the byte-level GPT example on a token file), resumed mid-schedule; metrics and evaluation.

- Resume mid-schedule equals the uninterrupted run exactly: a run of 4 steps saving every 2
  at dp2 x pp2 (FSDP2) with warmup + cosine, clipping, grad_accum 2 and a shuffled token
  file; resuming step-2 with the same --steps 4 prints steps 3 and 4 with the same loss,
  gradient norm and lr, bit for bit (same layout, same reduction order).
- grad_accum N equals an N x larger batch: the loss and global gradient norm of 3 SGD steps
  agree in fp32 (pp2 + dp2 FSDP2; pp1 + dp2 DDP, where inner microbatches skip the
  all-reduce).
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from parallelizer.checkpoint import read_manifest

TOKENS = Path(tempfile.gettempdir()) / f"pz-test-tokens-{os.getpid()}.bin"
EVAL = TOKENS.with_suffix(".eval.bin")
DATA = (f"data.path={TOKENS}", "data.seq_len=16", "data.batch_size=8")
_LOG = re.compile(r"^log step (\d+) \| loss (\S+) \| grad_norm (\S+) \| lr (\S+)", re.M)
RESUME = ("mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "pipeline.microbatches=2", "zero_stage=3",
          "optimizer.schedule.warmup_steps=2", "optimizer.schedule.decay=cosine",
          "optimizer.max_norm=1.0", "train.grad_accum=2", *DATA, f"data.eval={EVAL}")
SGD = ("optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.max_norm=null",
       "optimizer.schedule.warmup_steps=0", "optimizer.schedule.decay=constant", "data.shuffle=true")
ACCUM = {  # id -> the mesh; each compiled with grad_accum 2 x batch 8 and grad_accum 1 x batch 16
    "pp2-dp2-fsdp": ("mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "pipeline.microbatches=2", "zero_stage=3"),
    "pp1-dp2-ddp": ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "pipeline.microbatches=1", "zero_stage=0"),
}


def _accum(case, n):
    return (*ACCUM[case], f"data.path={TOKENS}", "data.seq_len=16", f"data.batch_size={16 // n}",
            f"train.grad_accum={n}", *SGD)


@pytest.fixture(scope="module", autouse=True)
def token_files():
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 16 * 200).astype(np.uint16).tofile(TOKENS)  # 200 windows of 16
    rng.integers(0, 256, 16 * 64).astype(np.uint16).tofile(EVAL)
    yield
    TOKENS.unlink(missing_ok=True)
    EVAL.unlink(missing_ok=True)


def _logged(stdout: str) -> dict[int, tuple[str, str, str]]:
    return {int(s): (loss, norm, lr) for s, loss, norm, lr in _LOG.findall(stdout)}


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt_bytes", *RESUME)
def test_resume_mid_schedule_equals_uninterrupted(compiled, tools, tmp_path):
    out = compiled("gpt_bytes", *RESUME)
    full = tools.torchrun(out, 4, "--train", "--steps", "4", "--save", str(tmp_path / "ck"),
                          "--save-every", "2", "--log-every", "1", "--eval-every", "2",
                          "--log-dir", str(tmp_path / "logs"))
    tools.check_exit(full)
    train = read_manifest(tmp_path / "ck" / "step-00000002")["train"]
    assert (train["step"], train["data_position"], train["grad_accum"]) == (2, 4, 2)
    assert train["schedule"]["last_epoch"] == 2 and train["schedule"]["_milestones"] == [2, 4]
    resumed = tools.torchrun(out, 4, "--train", "--steps", "4", "--resume",
                             str(tmp_path / "ck" / "step-00000002"), "--log-every", "1")
    tools.check_exit(resumed)
    assert f"resumed from {tmp_path / 'ck' / 'step-00000002'} at step 2" in resumed.stdout
    want, got = _logged(full.stdout), _logged(resumed.stdout)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4], resumed.explain()
    assert [want[3], want[4]] == [got[3], got[4]]  # loss, grad norm and lr, as printed
    # the position counts batches of 8 x 16: batches of 16 skipped windows 32-63 silently
    assert train["data_batches"] == {"batch_size": 8, "seq_len": 16}
    other = tools.torchrun(out, 4, "--train", "--steps", "4", "--batch-size", "16", "--resume",
                           str(tmp_path / "ck" / "step-00000002"))
    assert other.code == 2 and "its data position (4 batches) counts batches of 8 x 16 tokens, " \
        "this run reads 16 x 16, so it would skip or repeat data; resume with --batch-size 8 " \
        "--seq-len 16" in other.stderr and "step 3" not in other.stdout, other.explain()
    done = tools.torchrun(out, 4, "--train", "--steps", "4", "--resume",
                          str(tmp_path / "ck" / "step-00000004"))
    tools.check_exit(done)  # said, not silent: --steps counts the first run's steps too
    assert "nothing to train: the checkpoint is at step 4 and --steps 4 counts all steps" \
        in done.stdout, done.explain()
    # the cosine decay spans --steps - warmup: another --steps kept the first run's curve
    # silently (at min_lr from step 5 on: a break test)
    longer = tools.torchrun(out, 4, "--train", "--steps", "6", "--resume",
                            str(tmp_path / "ck" / "step-00000004"))
    assert longer.code == 2 and "its learning-rate schedule is not this run's" in longer.stderr \
        and "step 5" not in longer.stdout, longer.explain()
    lrs = [float(want[s][2]) for s in (1, 2, 3, 4)]  # warmup 2, cosine over 2 to min_lr 1e-4
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-4 + 0.9e-3 / 2], rel=1e-4)

    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    assert re.search(r"^log step 4 \| eval_loss \S+ \| perplexity \S+$", full.stdout, re.M)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["tokens"] for r in train_rows] == [2 * 8 * 16] * 4  # grad_accum x batch x seq
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train_rows)
    assert "metrics: mfu against a peak of" in full.stdout
    assert (tmp_path / "logs" / "loss.png").stat().st_size > 1000
    try:
        import tensorboard  # noqa: F401
        assert list((tmp_path / "logs").glob("events.out.tfevents.*"))
    except ImportError:
        assert "the tensorboard package is not installed" in full.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.precompile("gpt_bytes", *_accum(c, 2)),
                                                         pytest.mark.precompile("gpt_bytes", *_accum(c, 1))])
                                  for c in ACCUM])
def test_grad_accum_equals_a_larger_batch(compiled, tools, case):
    runs = {}
    for n in (2, 1):
        res = tools.torchrun(compiled("gpt_bytes", *_accum(case, n)), 4 if "pp2" in case else 2,
                             "--train", "--steps", "3", "--log-every", "1")
        tools.check_exit(res)
        runs[n] = _logged(res.stdout)
    assert sorted(runs[2]) == sorted(runs[1]) == [1, 2, 3]
    for step in (1, 2, 3):
        (la, na, _), (lb, nb, _) = runs[2][step], runs[1][step]
        print(f"\n{case} step {step}: grad_accum 2 loss {la} norm {na}; batch 16 loss {lb} norm {nb}", end="")
        assert abs(float(la) - float(lb)) <= 1e-5 and abs(float(na) - float(nb)) <= 1e-5, (step, runs)
    assert len({runs[1][s][0] for s in (1, 2, 3)}) == 3, "SGD at lr 0.5 must move the loss"


SYNC = {"ddp": ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "zero_stage=0", "pipeline.microbatches=1"),
        "fsdp": ("mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "zero_stage=3", "pipeline.microbatches=1")}


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt_bytes", *SYNC["ddp"])
@pytest.mark.precompile("gpt_bytes", *SYNC["fsdp"])
def test_inner_microbatches_skip_the_dp_reduction(compiled, tools):
    """A step of 4 accumulated microbatches runs as many gloo reductions (counted by
    torch.profiler) as a step of 1: DDP and FSDP2 reduce in the last backward only."""
    outs = [compiled("gpt_bytes", *SYNC[k]) for k in ("ddp", "fsdp")]
    res = tools.launch(Path(__file__).parent / "accum_sync_driver.py", 2, *outs).wait()
    rows = [json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(rows) == 2, res.explain()
    for kind, row in zip(("ddp", "fsdp"), rows):
        print(f"\n{kind}: reductions in a step of 1 microbatch {row['one']}, of 4 {row['four']}", end="")
        assert row["one"] == row["four"] and sum(row["one"].values()) > 0, (kind, row)


ONE = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "pipeline.microbatches=1")
MISSING = TOKENS.with_suffix(".late.bin")  # written by the test, after the compile


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt_bytes", *ONE, f"data.path={MISSING}", "data.seq_len=16", "data.batch_size=8")
@pytest.mark.precompile("gpt", *ONE)
def test_run_time_data_and_flag_errors(compiled, tools):
    """Each is one line naming the key, the file or flag, the value and the fix; nothing trains."""
    out = compiled("gpt_bytes", *ONE, f"data.path={MISSING}", "data.seq_len=16", "data.batch_size=8")
    cases = []
    try:
        MISSING.unlink(missing_ok=True)
        cases.append((None, f"data.path: {MISSING} does not exist; pass a .bin or .npy token file"))
        ids = np.zeros(16 * 20, np.uint16)
        ids[100] = 256  # the byte model's vocabulary is 0..255
        cases.append((ids, f"data.path: {MISSING} holds token id 256 (first bad one at position 100) "
                           f"but the model's vocabulary has 256 ids (0..255)"))
        cases.append((np.zeros(16 * 7, np.uint16), "holds 112 tokens = 7 windows of seq_len 16, "
                                                   "fewer than one batch of 8"))
        for ids, message in cases:
            if ids is not None:
                ids.tofile(MISSING)
            res = tools.torchrun(out, 1, "--train", "--steps", "1")
            assert res.code == 2 and message in res.stderr and "step 1 loss" not in res.stdout, res.explain()
        res = tools.torchrun(out, 1, "--train", "--steps", "1", "--eval-every", "1")
        assert res.code == 2 and "--eval-every needs a held-out split: set data.eval" in res.stderr, res.explain()
    finally:
        MISSING.unlink(missing_ok=True)
    res = tools.torchrun(compiled("gpt", *ONE), 1, "--train", "--steps", "1", "--batch-size", "4")
    assert res.code == 2 and "--batch-size / --seq-len: model.py defines batches()" in res.stderr, res.explain()


@pytest.mark.timeout(300)
@pytest.mark.precompile("gpt_bytes", *ONE)
def test_batch_size_and_seq_len_from_the_command_line(compiled, tools, tmp_path):
    """Synthetic batches (no batches(), no data:) take --batch-size and --seq-len."""
    out = compiled("gpt_bytes", *ONE)
    res = tools.torchrun(out, 1, "--train", "--steps", "2", "--batch-size", "3", "--seq-len", "20",
                         "--log-every", "1", "--log-dir", str(tmp_path))
    tools.check_exit(res)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [2 * 3 * 20] * 2  # the spec's grad_accum 2 x 3 x 20
