"""``compile: true``: each emitted block under torch.compile (inductor, CPU backend here)
still passes --verify against the unmodified model, parameter names unchanged. One rank: the
first step compiles the block (about 20 s on the CI machine); tp2 x pp2 passes too (3 min on
2 cores, in benchmarks/README.md)."""
from __future__ import annotations

import pytest

ONE = ("mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "pipeline.microbatches=1", "compile=true")


@pytest.mark.timeout(400)
@pytest.mark.precompile("gpt_bytes", *ONE)
def test_compiled_blocks_pass_verify(compiled, tools):
    res = tools.torchrun(compiled("gpt_bytes", *ONE), 1, "--verify", timeout=380)
    errs = tools.verify_errors(res.stdout)
    assert "compile: 4 block(s) of this rank under torch.compile (inductor)" in res.stdout, res.explain()
    assert res.stdout.rstrip().endswith("PASS") and set(errs) == {"loss", "outputs", "gradients",
                                                                  "parameters"}, res.explain()
    assert all(err <= 1e-5 for err in errs.values()), errs
    tools.check_exit(res)
