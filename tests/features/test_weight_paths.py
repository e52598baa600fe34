"""Any weight path (issue 23, part 4): linears whose weight is cast, viewed or transposed
before the matmul are found by their algebra and sharded Megatron-style; the tp ranks run
in lockstep in one process (tests/tp_lockstep.py) and give the unmodified model's outputs,
every gradient and the parameters after one SGD step (fp32, 1e-5).
Models: tests/tp_weight_path_models.py."""
from __future__ import annotations

import copy

import pytest
import torch

from parallelizer.analysis.graph_facts import as_linear
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from tp_lockstep import local, run_ranks
from tp_small_models import captured
from tp_weight_path_models import CastNet, x_batch

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1


def _loss(outs):
    g = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs
               if isinstance(o, torch.Tensor) and o.is_floating_point())


def assert_tp_matches(model, batch, tp, decision, gm):
    """Outputs, every gradient and the SGD-stepped parameters of each simulated rank equal
    the unmodified model's pieces."""
    ref = copy.deepcopy(model)
    outs = ref(*batch)
    outs = outs if isinstance(outs, tuple) else (outs,)
    _loss(outs).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for r, res in enumerate(run_ranks(gm, decision, tp, list(batch), _loss, LR)):
        for got, want in zip(res.outputs, outs):
            torch.testing.assert_close(got, want, **TOL)
        for fqn, grad in res.grads.items():
            torch.testing.assert_close(grad, local(grads[fqn], fqn, decision, tp, r), **TOL,
                                       msg=lambda m: f"rank {r} {fqn}: {m}")
            stepped = dict(ref.named_parameters())[fqn].detach() - LR * grads[fqn]
            torch.testing.assert_close(res.params[fqn], local(stepped, fqn, decision, tp, r),
                                       **TOL, msg=lambda m: f"rank {r} {fqn}: {m}")


def plan_and_check(model, batch, tp):
    cap = captured(model, batch)
    gm = cap.gm
    d = plan_tp(gm.graph, tp)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    assert_tp_matches(model, batch, tp, d, gm)
    return d


MODES = ["to", "type_as", "view", "io", "matmul_to", "float_T"]


@pytest.mark.parametrize("mode", MODES)
def test_linear_found_through_casts_views_and_transposes(mode):
    torch.manual_seed(0)
    cap = captured(CastNet(mode), x_batch())
    sites = {s.weight: s for s in map(as_linear, cap.gm.graph.nodes) if s is not None}
    assert len(sites) == 12, sorted(sites)
    up = sites["layers.0.up.weight"]
    assert up.bias == "layers.0.up.bias" and up.param.target == up.weight
    assert up.out_dim == (1 if mode == "io" else 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_cast_weights_shard_column_row_and_match(mode, tp):
    torch.manual_seed(0)
    model = CastNet(mode)
    d = plan_and_check(model, x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + f"attn.{n}.weight" for n in "qkv"} | {p + "up.weight"} <= d.column
        assert {p + "attn.o.weight", p + "down.weight"} <= d.row
    assert d.dims["layers.0.up.weight"] == (1 if mode == "io" else 0)
    assert d.dims["layers.0.up.bias"] == 0
