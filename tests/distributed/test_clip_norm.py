"""``optimizer.max_norm``: the global gradient norm of ``run.py --train`` at tp2 x pp2 x dp2
under ZeRO-3 (FSDP2 shards) with tied embeddings (the Llama example: embedding on stage 0,
LM head on stage 1) equals ``torch.nn.utils.clip_grad_norm_`` of the unmodified model within
1e-6, at step 1 and, after a clipped SGD update, at step 2 (so the clipping itself is checked
too: an unclipped or wrongly scaled step 1 moves the step-2 norm).

The tolerance separates the right count from every wrong one: the test computes, from the
reference gradients, the norm with the tp-replicated parameters (norms, row biases) counted
twice, the tied weight counted twice, and the dp replicas counted twice, and requires each to
be more than 100 x the tolerance away, so a runtime/clip.py that counted any of them twice
would fail here.
"""
from __future__ import annotations

import importlib.util
import itertools
import re

import pytest
import torch

from parallelizer.plan.parallel_plan import ParallelPlan

TOL = 1e-6
MAX_NORM = 0.5
LR = 0.1
MESH = ("mesh.dp=2", "mesh.tp=2", "mesh.pp=2", "zero_stage=3", "pipeline.microbatches=4",
        "optimizer.name=sgd", f"optimizer.lr={LR}", f"optimizer.max_norm={MAX_NORM}")
_LOG = re.compile(r"^log step (\d+) \| loss (\S+) \| grad_norm (\S+)", re.M)


def _eager(out, steps: int):
    """(per step: (loss, norm before clipping), reference gradients of step 1 by name)."""
    spec = importlib.util.spec_from_file_location("_clip_model", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build_model()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows, first = [], None
    for batch in itertools.islice(module.batches(), steps):
        opt.zero_grad(set_to_none=True)
        loss = module.loss_fn(model(**batch), batch)
        loss.backward()
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        rows.append((loss.item(), norm.item()))
    return rows, first


@pytest.mark.timeout(300)
@pytest.mark.precompile("llama", *MESH)
def test_global_grad_norm_equals_the_original_models(compiled, tools):
    out = compiled("llama", *MESH)
    plan = ParallelPlan.from_json((out / "plan.json").read_text())
    res = tools.torchrun(out, 8, "--train", "--steps", "2", "--log-every", "1")
    logged = [(int(s), float(loss), float(n)) for s, loss, n in _LOG.findall(res.stdout)]
    want, grads = _eager(out, 2)
    assert [s for s, _, _ in logged] == [1, 2], res.explain()
    for (step, loss, norm), (ref_loss, ref_norm) in zip(logged, want):
        print(f"\nstep {step}: grad norm {norm:.9f} original model {ref_norm:.9f} "
              f"diff {abs(norm - ref_norm):.2e}; loss {loss:.6f} vs {ref_loss:.6f}", end="")
        assert ref_norm > MAX_NORM, "clipping must be active for the step-2 check"
        assert abs(norm - ref_norm) <= TOL, (step, norm, ref_norm)
        assert abs(loss - ref_loss) <= 1e-5, (step, loss, ref_loss)

    # the tolerance tells every double count apart (module docstring)
    sq = {n: float(g.double().pow(2).sum()) for n, g in grads.items()}
    total = sum(sq.values())
    replicated = sum(v for n, v in sq.items() if plan.tensors[plan.aliases.get(n, n)].tp_dim is None)
    tied = sum(v for n, v in sq.items() if len(plan.tensors[plan.aliases.get(n, n)].stages) > 1)
    assert replicated > 0 and tied > 0, "the model must have tp-replicated and tied parameters"
    for name, extra in (("tp-replicated", replicated), ("tied", tied), ("dp replicas", total)):
        wrong = (total + extra) ** 0.5
        print(f"\n{name} counted twice: norm {wrong:.9f}, {abs(wrong - want[0][1]):.2e} away", end="")
        assert abs(wrong - want[0][1]) > 100 * TOL, name
    tools.check_exit(res)
