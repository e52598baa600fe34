"""A reduction across the heads dim after the heads view: ``k - k.mean(1, keepdim=True)``
(k centred over its heads), a sum, max, var or softmax over the heads (talking-heads style),
a max over (heads, head_dim). On head-sharded values DTensor's strategy gives a Partial
output (``Partial(avg)`` for the mean, ``Partial(sum)`` for the sum: an all-reduce after the
op) or gathers the heads first (max, var, softmax).

Two bugs the new-user run found, both internal errors before:

- the all-reduced mean enters sharded compute (``k - mean``), so its gradient (each rank's
  heads' share) needs an f. The planner derived that f, but the tensor_parallel pass put it
  on the mean's output *before* the all-reduce, whose readers no longer read it: the f was
  dead, the gradient of k wrong (the compile-time gradient check: "Mixed over tp").
- at tp 4 with 2 kv heads, the op over the heads refuses to carry copies of one kv head, so
  k's heads are split evenly (0 heads a rank), yet the heads constraint still allowed a tp
  that is a multiple of them. Now that constraint is plain divisibility, and the planner
  keeps k_proj whole (the report names the op that spans the heads), q, v and o sharded.

Each rank equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.analysis.gradient_accounting import check_gradients
from parallelizer.errors import PlanError
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime.tp import copy_to_tp_region, reduce_partial_from_tp

from tp_check import assert_tp_matches
from tp_small_models import H, captured, compile_steps, line_of, x_batch

HEADS, D = 4, 8

OPS = {
    "mean": lambda t: t - t.mean(dim=1, keepdim=True),
    "mean_nokeepdim": lambda t: t - t.mean(dim=1)[:, None],
    "sum": lambda t: t / (1 + t.sum(dim=1, keepdim=True).abs()),
    "amax": lambda t: t - t.amax(dim=1, keepdim=True),
    "var": lambda t: t / (1 + t.var(dim=1, keepdim=True)),
    "softmax": lambda t: t.softmax(dim=1),
    "amax_heads_head_dim": lambda t: t / t.abs().amax(dim=(1, 3), keepdim=True),
}


class HeadsReduced(nn.Module):
    """Attention with ``kv`` kv heads (GQA by SDPA's enable_gqa when fewer than 4), the op
    ``OPS[op]`` applied to q or k (``which``) of shape (B, heads, T, D)."""

    def __init__(self, kv=HEADS, op="mean", which="k"):
        super().__init__()
        self.kv, self.op, self.which = kv, OPS[op], which
        self.q, self.k, self.v = nn.Linear(H, HEADS * D), nn.Linear(H, kv * D), \
            nn.Linear(H, kv * D)
        self.o = nn.Linear(HEADS * D, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, D).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, D).transpose(1, 2)
        if self.which == "q":
            q = self.op(q)
        else:
            k = self.op(k)  # the op over the heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != HEADS)
        return x + self.o(y.transpose(1, 2).reshape(b, t, HEADS * D))


def _planned(tp, **kw):
    torch.manual_seed(0)
    model = HeadsReduced(**kw)
    cap = captured(model, x_batch())
    decision = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, decision)
    return model, cap.gm, decision


def _op_line() -> int:
    return line_of(__file__, "k = self.op(k)  # the op over the heads")


@pytest.mark.parametrize("tp", [2, 4])
def test_mean_over_the_heads_is_all_reduced_and_its_gradient_too(tp):
    """All four projections sharded; the mean's all-reduce (avg) is followed by the f the
    gradient analysis derived, which the subtraction reads (main before: the f sat before
    the all-reduce with no reader, and k's gradient was each rank's heads' share)."""
    model, gm, d = _planned(tp)
    assert {"q.weight", "k.weight", "v.weight"} <= d.column and d.row == {"o.weight"}
    (red,) = d.redistributions
    assert (red.kind, red.producer, red.reduce_op) == ("all_reduce", "mean", "avg")
    assert d.f_edges == {"mean": ["sub"]}
    (f,) = [n for n in gm.graph.nodes if n.target is copy_to_tp_region
            and n.args[0].target is not torch.ops.aten.embedding.default
            and n.args[0].op != "placeholder"]
    assert f.args[0].target is reduce_partial_from_tp
    assert [u.target for u in f.users] == [torch.ops.aten.sub.Tensor]
    assert_tp_matches(model, x_batch(), tp, d, gm)


@pytest.mark.parametrize("op", ["mean", "sum", "amax_heads_head_dim"])
def test_copies_of_kv_heads_refused_by_an_op_over_them_keep_k_whole(op):
    """tp 4, 2 kv heads: no rank can hold a copy of one kv head through an op across the kv
    heads, so k_proj is computed whole on every rank and attention cuts each rank's copy
    (main before: k_proj split evenly, a view into 0 heads a rank, an internal error)."""
    model, gm, d = _planned(4, kv=2, op=op)
    assert "k.weight" not in d.column and {"q.weight", "v.weight"} <= d.column
    assert d.layouts["v.weight"].kind == "replicated_heads"
    (kept,) = [line for line in d.report if line.startswith("kept whole: k.weight")]
    target = {"mean": "aten.mean.dim", "sum": "aten.sum.dim_IntList",
              "amax_heads_head_dim": "aten.amax.default"}[op]
    assert f"({target} (" in kept and f"test_tp_reduce_over_heads.py:{_op_line()} spans them" \
        in kept, kept
    assert any(r.kind == "scatter_copies" for r in d.redistributions)
    assert_tp_matches(model, x_batch(), 4, d, gm)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("op", ["mean_nokeepdim", "sum", "amax", "var", "softmax",
                                "amax_heads_head_dim"])
def test_ops_over_the_heads_match_the_model(op, which, tp):
    """q's 4 heads or k's 2 kv heads, at tp 2 and 4: each rank equals the model, and only
    k at tp 4 (its copies refused) is kept whole."""
    model, gm, d = _planned(tp, kv=2, op=op, which=which)
    whole = which == "k" and tp == 4
    assert ("k.weight" in d.column) != whole and {"q.weight", "v.weight"} <= d.column
    assert_tp_matches(model, x_batch(), tp, d, gm)


def test_compiled_program_passes_the_gradient_check():
    """The whole compile (sequence parallelism fuses q, k, v into one gathered linear) at
    tp 2: the program's gradients are what plan.grad_sync expects (main before: "the
    gradient of v.weight is Mixed over tp" at the mean's all-reduce)."""
    _, planned, stages, _ = compile_steps(HeadsReduced(), x_batch(4, 6), {"mesh": {"tp": 2}})
    assert planned.tp.f_edges == {"mean": ["sub"]}
    check_gradients(planned.plan, stages)


def _drop_f(decision):
    decision.f_edges.clear()


def test_missing_f_after_an_all_reduce_names_the_operator_not_its_repr():
    """With the f removed from the plan, the compile-time gradient check names the
    runtime's all-reduce by its module and name (not ``<function ... at 0x...>``) and the
    model's source line."""
    _, planned, stages, _ = compile_steps(HeadsReduced(), x_batch(4, 6), {"mesh": {"tp": 2}},
                                          mutate_tp=_drop_f)
    with pytest.raises(PlanError, match=rf"is Mixed over tp: a Partial gradient reaches "
                                        rf"sharded compute, at parallelizer\.runtime\.tp\."
                                        rf"reduce_partial_from_tp \(\w+\) at "
                                        rf"test_tp_reduce_over_heads.py:{_op_line()} ") as e:
        check_gradients(planned.plan, stages)
    assert "<function" not in str(e.value)

