"""A token-mean loss under data parallelism and microbatches (docs/models.md, "Loss inside
forward"): a Hugging Face causal LM on a left-padded batch (labels -100 spread unevenly over
the rows) at pp2 x dp2, ZeRO-1, 2 microbatches: 4 chunks, each averaging over a different
number of tokens. Every chunk's cross-entropy sum is divided by the whole batch's count
(summed over the chunks and the dp ranks before the step, runtime/token_mean.py), so the
program's loss, gradients and parameters are the whole batch's: ``--verify`` PASSes at 1e-5 on
4 gloo ranks. Before, each chunk divided by its own count: the compile warned and ``--verify``
FAILed on this batch (loss off by 1.5e-4, gradients by 2.2e-2; a break test found it on a
padded Helium).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from parallelizer.compiler import compile_model
from parallelizer.frontend.spec import load_spec

MODELS = Path(__file__).parent / "user_models"


@pytest.mark.timeout(300)
def test_padded_causal_lm_verifies_at_pp2_x_dp2_with_microbatches(tmp_path, tools):
    spec = load_spec(MODELS / "spec.yaml", ["mesh.pp=2", "mesh.dp=2", "zero_stage=1",
                                            "pipeline.microbatches=2"])
    program = compile_model(MODELS / "llama_padded_labels.py", spec)
    program.save(tmp_path / "out")
    assert program.plan.token_means["exact"], program.plan.token_means
    where = "token mean: the loss at transformers/models/llama/modeling_llama.py:"
    assert any(n.startswith(where) for n in program.notes)
    assert not any("not a mean over samples" in w for w in program.warnings), program.warnings
    res = tools.torchrun(tmp_path / "out", 4, "--verify", timeout=240)
    errs = tools.verify_errors(res.stdout)
    assert "PASS" in res.stdout and len(errs) == 4 and max(errs.values()) <= 1e-5, res.explain()
    tools.check_exit(res)
