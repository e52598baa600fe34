"""Dropout on the model-parallel streams, trained: GPT-2 with its default dropout (0.1) at
tp=2 x pp=2 (examples/gpt2_dropout), in one 4-rank launch of dropout_driver.py, with the
unmodified model's single-device runs computed meanwhile in this process.

- replicated activations (every block's output: the residual stream) bit-identical over the
  tp ranks in each of 20 training steps, and the replicated parameters after them; a
  control step with the replicated stream seeded per tp rank breaks that;
- the 20 per-step losses inside the band of 5 single-device runs with other seeds;
- 2 steps + save + resume for 2 (fresh streams and stages, as a new process) give the losses
  of steps 1-4 of the uninterrupted run, bit for bit, with every block's activations
  checkpointed in these two runs (the recompute must draw the forward's masks);
- run_verify PASSes with dropout inactive in the program and the reference.
(tp=pp=dp=1 against the eager model's own masks: tests/features/test_dropout.py.)
"""
from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallelizer.runtime.optim import make_optimizer
from parallelizer.runtime.rng import EagerDropoutOff

# sequence parallelism off: the checks compare the residual stream over the tp ranks, which
# SP holds as sequence shards (its dropout slices: tests/features/test_sequence_parallel.py)
EXAMPLE, MESH = "gpt2_dropout", ("mesh.dp=1", "mesh.tp=2", "mesh.pp=2",
                                 "tensor_parallel.sequence_parallel=false")
DRIVER = Path(__file__).with_name("dropout_driver.py")
STEPS, SEEDS, LATE = 20, (1, 2, 3, 4, 5), slice(10, 20)


def _single_device(out: Path, seed: int | None) -> list[float]:
    """The unmodified model trained as run.py --train trains the program (same weights,
    batches, loss and optimizer) after ``torch.manual_seed(seed)``; dropout off for None."""
    spec = importlib.util.spec_from_file_location(f"_eager_{out.name}", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ocfg = OmegaConf.load(out / "spec.yaml").optimizer
    model = module.build_model()
    model.train()
    opt = make_optimizer(model.parameters(), ocfg.name, ocfg.lr, ocfg.weight_decay)
    torch.manual_seed(0 if seed is None else seed)
    losses = []
    for batch in itertools.islice(module.batches(), STEPS):
        opt.zero_grad(set_to_none=True)
        if seed is None:
            with EagerDropoutOff():
                outputs = model(**batch)
        else:
            outputs = model(**batch)
        loss = module.loss_fn(outputs, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _band(runs: list[list[float]]):
    """The band of the single-device ``runs`` (5 seeds), stated:

    - per step: [min - 2M, max + 2M] over the runs, M = the mean over the 20 steps of
      (max - min). The min-max of 5 runs alone is no band for a 6th run: it lands inside
      with probability 2/3 per step, (2/3)^20 over 20 steps (held for 0 of 10 further eager
      runs; with a margin of 1M for 39 of 40, and a correct tp2 x pp2 run was once 5e-4 out).
    - the mean loss of steps 11-20: [lo - w, hi + w], lo/hi the runs' min/max of it, w = hi -
      lo. Measured over 45 seeds: 40 of 40 further runs inside, while a run without dropout
      (0.038 lower) and one with p = 0.2 (0.032 higher) fall outside: this is the check with
      power; the per-step band catches gross errors of single steps.
    """
    lo = [min(r[i] for r in runs) for i in range(STEPS)]
    hi = [max(r[i] for r in runs) for i in range(STEPS)]
    m = sum(h - l for l, h in zip(lo, hi)) / STEPS
    late = [sum(r[LATE]) / len(r[LATE]) for r in runs]
    w = max(late) - min(late)
    return [(l - 2 * m, h + 2 * m) for l, h in zip(lo, hi)], (min(late) - w, max(late) + w)


@pytest.mark.timeout(400)
@pytest.mark.precompile(EXAMPLE, *MESH)
def test_dropout_training_at_tp2_pp2(compiled, tools, tmp_path):
    out = compiled(EXAMPLE, *MESH)
    ranks = tools.launch(DRIVER, 4, out, STEPS, tmp_path / "s2", cwd=tmp_path, timeout=300)
    # the single-device runs while the ranks run
    runs = [_single_device(out, seed) for seed in SEEDS]
    no_dropout = _single_device(out, None)
    res = ranks.wait()
    stdout, explain = res.stdout, res.explain()
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert res.code == 0 and len(lines) == 1, explain
    r = json.loads(lines[0][len("RESULT "):])

    # replicated regions: the same masks on both tp ranks of each stage, through 20 steps
    assert r["block_outputs"] >= 4 * STEPS * 4, r  # 4 ranks, 20 steps x 4 microbatches, >= 1 block
    assert r["activation_mismatches"] == 0 and r["parameter_mismatches"] == 0, r
    assert r["replicated_parameters"] > 0 and r["control_mismatches"] > 0, r

    per_step, late = _band(runs)
    losses = r["losses"]
    print(f"\nlosses {[round(x, 4) for x in losses]}\nband {[(round(a, 4), round(b, 4)) for a, b in per_step]}"
          f"\nlate mean {sum(losses[LATE]) / 10:.4f} in {late}; no dropout {sum(no_dropout[LATE]) / 10:.4f}")
    assert len(losses) == STEPS
    for step, (loss, (lo, hi)) in enumerate(zip(losses, per_step), 1):
        assert lo <= loss <= hi, (step, loss, lo, hi)
    assert late[0] <= sum(losses[LATE]) / 10 <= late[1], (losses, late)
    # the band can tell: the model without dropout trains outside it
    assert not late[0] <= sum(no_dropout[LATE]) / 10 <= late[1], (no_dropout, late)

    assert r["save_resume_losses"] == losses[:4], (r["save_resume_losses"], losses[:4])
    assert r["verify_exit"] == 0 and "verify: dropout inactive in the reference and the program" in stdout
    assert stdout.count("\nPASS") == 1, explain
