"""Sequence-parallel operators (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", §4.2.2, Fig. 5).

Between the tensor-parallel regions (norms, dropout, residual adds) each tp rank holds only
its shard of the sequence: ``Shard(dim)`` of a (batch, seq, ...) value, rank ``r`` holding
positions ``[r * s / tp, (r + 1) * s / tp)``. A value whose batch and sequence dims were
flattened into one (GPT-2's Conv1D reads (batch * seq, hidden)) is handled by giving the
operators the global sequence length ``seq``: they unflatten ``dim`` into (batch, seq), work
on the sequence and flatten back, so the local rows are (batch, seq / tp) flattened.

- :func:`reduce_scatter_to_sequence_parallel_region` is Megatron's g under sequence
  parallelism: the Partial outputs of a row_parallel linear are summed and scattered along the
  sequence (backward: all-gather).
- :func:`all_gather_from_sequence_parallel_region` is f: the sequence shards are gathered
  before column_parallel linears (backward: reduce-scatter of the ranks' partial gradients).
- :func:`split_to_sequence_parallel_region`: a replicated value (the embedding's output,
  GPT-2's position embedding) enters a sequence-parallel region as this rank's slice, no
  communication; backward all-gathers, since every rank computed the same full value and
  needs the gradient of all of it.
- :func:`gather_from_sequence_parallel_region`: a sequence-parallel value leaves to
  replicated compute (the LM head, the model's outputs): all-gather; backward keeps this
  rank's slice, since every rank then computes the same full gradient.

Sequence lengths are dynamic; one not divisible by the tp degree fails at the first
operator with :class:`SequenceLengthError` (no padding: padded positions would enter the
norms' and residuals' results and the attention of the next layer).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import rng
from .tp import tp_group


class SequenceLengthError(ValueError):
    """A sequence length not divisible by the tp degree under sequence parallelism."""


class ProcessGroupComm:
    """The transport of the operators: torch.distributed collectives over the tp group
    (``runtime/tp.py``'s). Tests simulating tp ranks in one process give their own object
    with the same four members."""

    def size(self) -> int:
        group = tp_group()
        return 1 if group is None else dist.get_world_size(group)

    def rank(self) -> int:
        group = tp_group()
        return 0 if group is None else dist.get_rank(group)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' contiguous ``t`` along dim 0, in rank order."""
        out = t.new_empty((t.shape[0] * self.size(),) + tuple(t.shape[1:]))
        dist.all_gather_single(out, t, group=tp_group())
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' contiguous ``t`` and keep this rank's 1/tp of dim 0."""
        out = t.new_empty((t.shape[0] // self.size(),) + tuple(t.shape[1:]))
        dist.reduce_scatter_single(out, t, group=tp_group())
        return out


COMM = ProcessGroupComm()


class ShapeComm:
    """Rank 0 of ``tp`` ranks without communicating: the collectives give the shapes they
    would (gathered rows are this rank's repeated), for FakeTensor tracing of a stage's
    per-rank activations (``advisor/activations.py``)."""

    def __init__(self, tp: int):
        self.tp = tp

    def size(self) -> int:
        return self.tp

    def rank(self) -> int:
        return 0

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t] * self.tp, 0)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, 0, t.shape[0] // self.tp).clone()


@contextlib.contextmanager
def using_comm(comm):
    """Within the block, the sequence-parallel operators use ``comm`` as their transport."""
    global COMM
    before, COMM = COMM, comm
    try:
        yield
    finally:
        COMM = before


def _check(length: int, tp: int) -> None:
    if length % tp:
        raise SequenceLengthError(
            f"sequence parallelism: the sequence length ({length}) is not divisible by mesh.tp "
            f"({tp}); feed sequences whose length is a multiple of {tp} (pad them in the data "
            f"pipeline), or compile with tensor_parallel.sequence_parallel=false")


def sequence_shard_length(seq: int, tp: int) -> int:
    """This rank's sequence length ``seq / tp`` (the shape constants of views in a
    sequence-parallel region). Raises SequenceLengthError when ``tp`` does not divide ``seq``."""
    _check(int(seq), tp)
    return seq // tp


def _unflat(x: torch.Tensor, dim: int, seq):
    """(tensor with the sequence on its own dim, that dim, how to undo it)."""
    if seq is None:
        return x, dim, lambda t: t
    return x.unflatten(dim, (-1, seq)), dim + 1, lambda t: t.flatten(dim, dim + 1)


def _local(seq, tp):
    return None if seq is None else seq // tp


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and not a view: the operators' outputs are the model's values, which
    it may modify in place (Falcon's ``mlp_output += attention_output``), and autograd
    forbids that on a view a custom Function returns ("Output 0 of Op is a view and is
    being modified inplace"). The moves below copy already, except when the moved dims hold
    one element (a microbatch of one sequence) or a flatten keeps the copy's layout: then
    the view is copied once here."""
    t = t.contiguous()
    return t.clone() if t._is_view() else t


def _all_gather(comm, x: torch.Tensor, dim: int, seq) -> torch.Tensor:
    """``seq``: the global length when ``dim`` is flattened (batch, seq), else None."""
    u, d, back = _unflat(x, dim, _local(seq, comm.size()))
    out = comm.all_gather(u.movedim(d, 0).contiguous())
    # contiguous: q, k and v (gate and up) then share one saved input, not a copy each
    return _own(back(out.movedim(0, d)))


def _reduce_scatter(comm, x: torch.Tensor, dim: int, seq) -> torch.Tensor:
    u, d, back = _unflat(x, dim, seq)
    _check(u.shape[d], comm.size())
    out = comm.reduce_scatter(u.movedim(d, 0).contiguous())
    return _own(back(out.movedim(0, d)))


def _split(comm, x: torch.Tensor, dim: int, seq) -> torch.Tensor:
    tp = comm.size()
    u, d, back = _unflat(x, dim, seq)
    _check(u.shape[d], tp)
    n = u.shape[d] // tp
    return _own(back(u.narrow(d, comm.rank() * n, n)))


def _operator(forward, backward):
    """An autograd Function ``apply(x, dim, seq, comm)`` running ``forward`` / ``backward``."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, seq, comm):
            ctx.args = (dim, seq, comm)
            return forward(comm, x, dim, seq)

        @staticmethod
        def backward(ctx, grad):
            dim, seq, comm = ctx.args
            return backward(comm, grad, dim, seq), None, None, None

    return Op


ReduceScatter = _operator(_reduce_scatter, _all_gather)
AllGather = _operator(_all_gather, _reduce_scatter)
Split = _operator(_split, _all_gather)
Gather = _operator(_all_gather, _split)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int, seq=None):
    """g under sequence parallelism: (..., s, ...) Partial -> (..., s / tp, ...) summed over
    tp. ``seq``: the global sequence length when ``dim`` is batch and sequence flattened."""
    return x if COMM.size() == 1 else ReduceScatter.apply(x, dim, seq, COMM)


def all_gather_from_sequence_parallel_region(x: torch.Tensor, dim: int, seq=None):
    """f under sequence parallelism: (..., s / tp, ...) -> (..., s, ...) before
    column_parallel linears; the gradient is reduce-scattered."""
    return x if COMM.size() == 1 else AllGather.apply(x, dim, seq, COMM)


def split_to_sequence_parallel_region(x: torch.Tensor, dim: int, seq=None):
    """A replicated value entering a sequence-parallel region: this rank's slice (no
    communication); the gradient is all-gathered. The seam where a vocab-parallel
    embedding's all-reduce + split becomes one reduce-scatter."""
    return x if COMM.size() == 1 else Split.apply(x, dim, seq, COMM)


def gather_from_sequence_parallel_region(x: torch.Tensor, dim: int, seq=None):
    """A sequence-parallel value leaving to replicated compute: all-gather; backward keeps
    this rank's slice of the (identical on every rank) gradient."""
    return x if COMM.size() == 1 else Gather.apply(x, dim, seq, COMM)


def _linear_forward(kind: str, x, w, b):
    if kind == "linear":  # nn.Linear: x (..., in) @ w (out, in).T + b
        return torch.ops.aten.linear.default(x, w, b) if b is not None else \
            torch.ops.aten.linear.default(x, w)
    if kind == "addmm":  # GPT-2's Conv1D: b + x (n, in) @ w (in, out)
        return torch.ops.aten.addmm.default(b, x, w)
    return torch.ops.aten.mm.default(x, w)  # "mm": a row of Conv1D without its bias


def _linear_backward(kind: str, x, g, w, b, need_w: bool, need_b: bool):
    """(grad of x, of w, of b) of :func:`_linear_forward`. Under autocast the forward ran in
    the gradient's dtype (bf16/fp16) on fp32 ``x`` and ``w``: the matmuls run in that dtype
    as autocast's would, each gradient returned in its input's dtype (no-op casts in fp32)."""
    dt = g.dtype
    x2, g2, wc = x.reshape(-1, x.shape[-1]).to(dt), g.reshape(-1, g.shape[-1]), w.to(dt)
    if kind == "linear":
        gx = (g2 @ wc).view(*g.shape[:-1], w.shape[1])
        gw = g2.t() @ x2 if need_w else None
    else:
        gx = g2 @ wc.t()
        gw = x2.t() @ g2 if need_w else None
    gb = g2.sum(0).to(b.dtype) if need_b and b is not None else None
    return gx.to(x.dtype), None if gw is None else gw.to(w.dtype), gb


class GatheredLinears(torch.autograd.Function):
    """f under sequence parallelism fused with the column_parallel linears reading its output
    (q|k|v, gate|up): all-gather the sequence shard, run each linear on the gathered input;
    save only the shard and all-gather it again in backward for the weight gradients
    (Korthikanti et al. 2022, §4.2.2: the activations kept are sbh/t; Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``), then reduce-scatter the summed
    input gradient. ``apply(shard, dim, seq, comm, kinds, w0, b0, w1, b1, ...)`` -> a tuple of
    the linears' outputs."""

    @staticmethod
    def forward(ctx, shard, dim, seq, comm, kinds, *params):
        full = _all_gather(comm, shard, dim, seq)
        ctx.args = (dim, seq, comm, kinds)
        # an output nothing differentiable reads (a dead branch: LiLT's last layout value)
        # gives its linear no gradient, None as unfused autograd leaves it, not zeros
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(shard, *params)
        flat = full.reshape(-1, full.shape[-1])  # 2-D outputs: see gathered_linears_over
        return tuple(_linear_forward(k, flat, params[2 * i], params[2 * i + 1])
                     for i, k in enumerate(kinds))

    @staticmethod
    def backward(ctx, *grads):
        dim, seq, comm, kinds = ctx.args
        shard, *params = ctx.saved_tensors
        gathered = _all_gather(comm, shard, dim, seq)
        full = gathered.reshape(-1, gathered.shape[-1])
        gx, out = None, []
        for i, (kind, g) in enumerate(zip(kinds, grads)):
            w, b = params[2 * i], params[2 * i + 1]
            if g is None:
                out += [None, None]
                continue
            gxi, gw, gb = _linear_backward(kind, full, g, w, b, ctx.needs_input_grad[5 + 2 * i],
                                           ctx.needs_input_grad[6 + 2 * i])
            gx = gxi if gx is None else gx + gxi
            out += [gw, gb]
        gshard = None if gx is None else _reduce_scatter(comm, gx.view(gathered.shape), dim, seq)
        return (gshard, None, None, None, None, *out)


def gathered_linears(shard: torch.Tensor, dim: int, seq, kinds: tuple, *params):
    """:class:`GatheredLinears` over the tp group; ``kinds``: "linear" | "addmm" | "mm" per
    linear, ``params``: its weight and bias (None) in turn. Outputs: one per linear, as the
    unfused ops give them."""
    if COMM.size() == 1:
        return tuple(_linear_forward(k, shard, params[2 * i], params[2 * i + 1])
                     for i, k in enumerate(kinds))
    return gathered_linears_over(COMM, shard, dim, seq, kinds, *params)


def gathered_linears_over(comm, shard: torch.Tensor, dim: int, seq, kinds: tuple, *params):
    """:class:`GatheredLinears` over ``comm``, each output viewed to the gathered input's
    leading dims here, outside the Function: a view made inside a custom Function may not be
    modified in place ("Output 0 of GatheredLinears is a view and is being modified inplace":
    nn.ReLU(inplace=True) after fc, a break test), one made outside is an ordinary view
    autograd rebases."""
    lead = list(shard.shape[:-1])
    lead[dim % shard.dim()] *= comm.size()
    outs = GatheredLinears.apply(shard, dim, seq, comm, tuple(kinds), *params)
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)


def random_op_on_sequence_shard(stream: str, op: str, dim: int, seq, *args, comm=None, **kwargs):
    """A dropout (``rng.random_op``) on this rank's sequence shard ``args[0]`` that applies
    this rank's slice of the mask the unsharded program draws: the mask of the full shape is
    drawn from ``stream`` (on ones, so it holds the scale too) and sliced. Same outputs as
    the op (dropout: the tensor; native_dropout: (tensor, mask)). Costs one full-shape
    mask per call (transient)."""
    x, rest = args[0], args[1:]
    comm = comm or COMM
    tp = comm.size()
    if tp == 1:
        return rng.random_op(stream, op, *args, **kwargs)
    u, d, back = _unflat(x, dim, _local(seq, tp))
    full = list(u.shape)
    full[d] *= tp
    drawn = rng.random_op(stream, op, u.new_ones(full), *rest, **kwargs)
    n = u.shape[d]

    def mine(t):
        return back(t.narrow(d, comm.rank() * n, n))

    if isinstance(drawn, tuple):  # native_dropout: (ones * mask * scale, mask)
        return x * mine(drawn[0]), mine(drawn[1])
    return x * mine(drawn)


def random_op_on_tp_shard(stream: str, op: str, dim: int, *args, comm=None, **kwargs):
    """A random op (``rng.random_op``, a "template" op of ``RANDOM_OPS``: ``rand_like``,
    ``exponential_``, ...) whose output is sharded over tp on ``dim``: the full tensor the
    unsharded program draws is drawn from ``stream`` (the replicated one: equal on every tp
    rank) and this rank's block of ``dim`` kept, as :func:`random_op_on_sequence_shard`
    keeps its slice of a dropout mask. ``args[0]`` is this rank's shard (the op's template;
    an in-place op writes its block into it). Costs one full-shape draw per call
    (transient). Under ``--verify`` (``rng.dropout_active(False)``) the op's stand-in is the
    same for any shape, so the local op gives it."""
    x, rest = args[0], args[1:]
    comm = comm or COMM
    tp = comm.size()
    if tp == 1 or not rng.drawing():
        return rng.random_op(stream, op, *args, **kwargs)
    full = list(x.shape)
    n, full[dim] = x.shape[dim], x.shape[dim] * tp
    drawn = rng.random_op(stream, op, x.new_empty(full), *rest, **kwargs)
    mine = drawn.narrow(dim, comm.rank() * n, n)
    if op.split(".")[1].endswith("_"):  # in place: the op's output is its template
        return x.copy_(mine)
    return mine.contiguous()
