"""Random ops outside dropout at tp2 (issue 23; planning/dropout.plan_random_ops,
passes/dropout.py, runtime/rng.py, runtime/sequence.random_op_on_tp_shard): a stochastic
depth drop path's ``torch.rand`` over (batch, 1, 1) after a column/row linear pair draws from
the tp-shared stream, and a ``rand_like`` of the column linear's (sharded) activation is
drawn whole from it and sliced, so in training mode every tp rank's outputs, gradients and
SGD step equal the unmodified model's after ``torch.manual_seed(seed)`` (Megatron-LM's
model-parallel RNG, Shoeybi et al. 2019 §3). --verify's stand-ins: the same fixed values in
the eager reference (``RandomStandIns``) and the program (``dropout_active(False)``).
The refusals (a sharded draw from its input's values; an op with no stand-in) are in
tests/features/test_compile_checks.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.analysis.sharding.placements import CONFLICT, Shard
from parallelizer.errors import PlanError
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.dropout import apply_rng_streams
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.parallel_plan import RANDOM_OPS
from parallelizer.planning.dropout import plan_random_ops
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime import rng
from parallelizer.runtime.rng import _STAND_INS, RandomStandIns
from parallelizer.runtime.sequence import random_op_on_tp_shard
from tp_check import TOL, assert_tp_matches
from tp_lockstep import forward_ranks
from tp_small_models import H, captured, compile_steps, line_of, x_batch

SEED = 3


class DropPathMLP(nn.Module):
    """A residual MLP (column then row linear) with BEiT's / Swin's drop path (a
    ``torch.rand`` per sample) and multiplicative noise on the sharded hidden activation."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        h = F.gelu(self.up(x))
        h = h * (0.75 + 0.5 * torch.rand_like(h))
        keep = (0.9 + torch.rand(x.shape[0], 1, 1, dtype=x.dtype)).floor_()
        return x + self.down(h).div(0.9) * keep


@pytest.fixture(autouse=True)
def _fresh_streams():
    yield
    rng._seeds.clear()
    rng._generators.clear()


def _program(model, batch, tp=2):
    gm = captured(model, batch).gm
    decision = plan_tp(gm.graph, tp)
    sites = plan_random_ops(gm.graph, decision.placements, tp)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, decision)
    apply_rng_streams(gm, sites)
    return gm, decision, sites


def test_drop_path_and_sharded_noise_draw_the_unmodified_models_values_at_tp2():
    """The sites: the noise on the column linear's activation (sharded on its last dim)
    is drawn whole, the drop path's mask (replicated) as it is, both from the replicated
    stream. Training mode, seeded: each rank's outputs, gradients and stepped parameters
    equal the model's; the seed drops a sample (its output is its input) and keeps others,
    so the masks were drawn, not all ones."""
    model, batch = DropPathMLP(), x_batch(8, 5)
    gm, decision, sites = _program(model, batch)
    assert [(s.op, s.stream, s.dim) for s in sites] == [
        ("aten.rand_like.default", "replicated", 2), ("aten.rand.default", "replicated", None)]
    assert decision.dims["up.weight"] == 0 and decision.dims["down.weight"] == 1
    (out,) = assert_tp_matches(model, batch, 2, decision, gm, seed=SEED)
    x = batch[0]
    dropped = [(out[b] == x[b]).all().item() for b in range(x.shape[0])]
    assert any(dropped) and not all(dropped), dropped
    torch.manual_seed(SEED + 1)
    assert not torch.allclose(DropPathMLP.forward(model, x), out)  # other seed, other draws


def test_verify_stand_ins_are_the_same_in_the_reference_and_the_program():
    """--verify: the model under RandomStandIns (the reference's mode) and each rank under
    dropout_active(False) compute the same thing, the drop path keeping every sample
    (0.9 + 0.5 floors to 1) and the noise factor 0.75 + 0.5 * 0.5 = 1; nothing is drawn
    from the streams."""
    model, batch = DropPathMLP(), x_batch(8, 5)
    gm, decision, _ = _program(model, batch)
    x = batch[0]
    with torch.no_grad():
        with RandomStandIns():
            want = model(x)
        torch.testing.assert_close(want, x + model.down(F.gelu(model.up(x))) / 0.9)
        rng.seed_streams(SEED, 0, 0, 0, 2)
        with rng.dropout_active(False):
            got = forward_ranks(gm, decision, 2, [x])
    for outs in got:
        torch.testing.assert_close(outs[0], want, **TOL)
    assert rng.state_dict() == {}


def test_stand_ins_cover_every_planned_random_op():
    """Every op the planner routes through the streams has a --verify stand-in, fixed
    whatever the shape (a slice of a stand-in is the stand-in of the slice)."""
    # and the ``.generator`` overloads the eager model calls with generator=None, which the
    # captured graph spells as the default ones (frontend/capture.py)
    eager = {"aten.rand.generator", "aten.randn.generator", "aten.randint.generator",
             "aten.randint.low_generator", "aten.randperm.generator"}
    assert set(_STAND_INS) == set(RANDOM_OPS) | eager
    with RandomStandIns():
        assert torch.equal(torch.rand(3, 2), torch.full((3, 2), 0.5))
        assert torch.equal(torch.empty(4).exponential_(2.0), torch.full((4,), 0.5))
        assert torch.equal(torch.bernoulli(torch.tensor([0.2, 0.9])), torch.tensor([0.2, 0.9]))
        assert torch.equal(torch.randperm(4), torch.arange(4))
        probs = torch.tensor([[0.1, 0.6, 0.3]])
        assert torch.equal(torch.multinomial(probs, 2), torch.tensor([[1, 2]]))
        assert torch.equal(torch.randint(2, 9, (2,)), torch.tensor([5, 5]))


def test_drop_path_compiles_at_tp2_onto_the_replicated_stream():
    """The whole compiler: the drop path's node runs as rng.random_op on the replicated
    stream, the sharded noise as random_op_on_tp_shard on its dim, both in plan.random."""
    _analysis, planned, stages, _seq = compile_steps(DropPathMLP(), x_batch(4, 6),
                                                     {"mesh": {"tp": 2}})
    assert [(r["op"], r["dim"]) for r in planned.plan.random] == [
        ("aten.rand_like.default", 2), ("aten.rand.default", None)]
    calls = [(n.target.__name__, n.args[:3]) for n in stages[0].graph.nodes
             if n.target in (rng.random_op, random_op_on_tp_shard)]
    assert [(f, a[:2]) for f, a in calls] == [
        ("random_op_on_tp_shard", ("replicated", "aten.rand_like.default")),
        ("random_op", ("replicated", "aten.rand.default"))]
    assert calls[0][1][2] == 2


def test_sharded_draws_that_cannot_be_cut_into_blocks_are_refused():
    """plan_random_ops on placements the tp planner could give (data, not the graph): the
    noise sharded on its sequence dim (symbolic size), on its 128 features at tp 3, or with
    no single placement (a Conflict) is refused, naming the op and line; 128 at tp 2 is cut."""
    gm = captured(DropPathMLP(), x_batch(8, 5)).gm
    node = next(n for n in gm.graph.nodes if str(n.target) == "aten.rand_like.default")
    line = line_of(__file__, "h = h * (0.75 + 0.5 * torch.rand_like(h))")
    head = rf"aten.rand_like.default \(rand_like\) in the root module at " \
           rf"test_random_streams.py:{line} draws a tensor with "
    for place, tp, what in ((Shard(1), 2, r"dim 1 of size s\d+ sharded over tp, not a constant "
                                          r"multiple of 2: its full draw cannot be cut"),
                            (Shard(2), 3, r"dim 2 of size 128 sharded over tp, not a constant "
                                          r"multiple of 3"),
                            (CONFLICT, 2, r"no single placement over tp \(Conflict\(\)\)")):
        with pytest.raises(PlanError, match=rf"mesh.tp={tp}: " + head + what):
            plan_random_ops(gm.graph, {node.name: place}, tp)
    assert plan_random_ops(gm.graph, {node.name: Shard(2)}, 2)[0].dim == 2
