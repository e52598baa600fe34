"""Gradient placements over tp: the dual (cotangent) of sharding propagation.

Megatron-LM (Shoeybi et al. 2019, §3) writes the backward of tensor parallelism as two
operators: ``f`` (identity forward, all-reduce of the gradient backward) before the
column_parallel linears, ``g`` (all-reduce forward, identity backward) after the row ones.
That the other gradients need nothing is an assumption about the model; this module derives
it instead, for every value of a graph, from the forward placements alone, and names the
places where it does not hold. In DTensor's terms (``torch.distributed.tensor``): a
gradient is *whole* when each rank holds the true gradient of its local value (Replicate of
a replicated value, Shard(d) of a sharded one), ``Partial`` when the true gradient is the
sum over the tp ranks of what each holds, and :class:`Mixed` when it is neither (a
replicated value read both as a whole and by sharded compute: ``r + p_i`` on rank ``i``
instead of ``r + sum_i p_i``, wrong on every rank).

The rules, one classification of ops (backward is linear in the cotangent, so each rule
is exact whatever the op computes):

- the model's outputs have whole cotangents (vocab_parallel logits handed to ``loss_fn`` as
  DTensor Shard(-1) are a sharded value with a whole cotangent);
- ``f`` (``role`` "f": copy_to_tp_region, the sequence-parallel all-gather): a Partial
  output cotangent becomes whole (its all-reduce / reduce-scatter sums it); a whole one would
  be counted tp times (Mixed);
- ``split`` (scatter_to_tp_region, the sequence-parallel split: each rank keeps its slice,
  backward all-gathers): a whole cotangent stays whole;
- *replicated compute* (no input and no output varies over the tp ranks): every input gets
  its output's cotangent, unchanged (Partial stays Partial: sum and backward commute);
- *sharded compute* (an input or its output varies): a sharded input gets a whole
  cotangent; a replicated input that carries a gradient gets a **Partial** one, each rank
  seeing only its shard's effect (a q/k norm weight applied to the rank's heads, a bias
  added to a sharded value). Given a non-whole output cotangent, every input is Mixed;
- contributions of several readers combine: equal kinds stay, whole + Partial is Mixed.

A replicated *activation* (a value computed from the model's inputs) entering sharded
compute gets an ``f`` on that edge instead (``flow.f_edges``; one f per producer, as the
column linears' inputs have): its cotangent is then whole. A value computed from parameters
alone keeps the Partial cotangent down to the parameters, whose gradients are then summed
over tp once per step (``plan.grad_sync`` kind ``partial_tp``). The issue's joint-graph
route (``aot_export_joint_with_descriptors``) would give the same answer: every op falls in
one class above, so the coverage is that of the forward placements (DTensor's strategies and
our rules), which the planner already checks for every node.

Forward models (:mod:`.gradient_forward`) say, per node, whether its value varies over the
tp ranks and which role it plays: on the captured graph with the planner's placements and
planned f/g, or on the rewritten stage graphs with the operators the passes inserted.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .gradient_forward import value_inputs
from .graph_facts import aten, module_path, source_line
from .writes import written_args

WHOLE, PARTIAL, MIXED = "whole", "partial", "mixed"

# float-valued ops whose output does not depend differentiably on their tensor inputs
_NO_GRADIENT = {aten.detach.default, aten.new_ones.default, aten.new_zeros.default,
                aten.new_empty.default, aten.new_full.default, aten.zeros_like.default,
                aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
                aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                aten.bernoulli.p, aten.bernoulli.default, aten.lift_fresh_copy.default,
                aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}




@dataclass(frozen=True)
class Mixed:
    """A gradient placement DTensor has no name for: a replicated value whose gradient is
    whole from some readers and Partial from others (wrong on every rank)."""


@dataclass(frozen=True)
class Cot:
    """The cotangent placement of one value: ``kind`` (whole | partial | mixed) and the node
    that made it partial or mixed (``origin``), with the readers that disagreed (``why``)."""
    kind: str
    origin: str = ""
    why: str = ""


_WHOLE = Cot(WHOLE)


class Forward(Protocol):
    """What the analysis needs of the forward (see :mod:`.gradient_forward`)."""

    def varying(self, node: fx.Node) -> bool:
        """The value differs over the tp ranks (a shard, a Partial sum, a rank's heads)."""

    def varying_input(self, node: fx.Node, arg: fx.Node) -> bool:
        """``node`` reads input ``arg`` as a value that differs over the tp ranks (``arg``
        varies, unless a planned gather makes it whole on that edge, or a planned cut of a
        replicated ``arg`` gives each rank its block)."""

    def role(self, node: fx.Node, arg: fx.Node) -> str:
        """How ``node`` treats input ``arg``'s gradient: "f" | "split" (a cut: each rank's
        block, the gradient all-gathered) | "gather" (an all-gather: the rank's slice of the
        gradient) | "whole" (a planned f: the input's cotangent is whole) | "after_g" (a row
        bias added after g: the output cotangent, unchanged) | "compute" (the rules of the
        module docstring)."""


@dataclass
class GradientFlow:
    """The result of :func:`derive`.

    Attributes:
        values: node name -> :class:`Cot` of every value a gradient reaches.
        params: get_attr target -> :class:`Cot` (all its reads combined).
        f_edges: replicated activation (node name) -> the sharded-compute nodes reading it
            that need an ``f`` on that edge, in graph order.
        inputs: cotangents of the graph's placeholders, in order (None: no gradient).
        nodes: node name -> node, for messages.
    """
    values: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    f_edges: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)
    nodes: dict = field(default_factory=dict)

    def partial_params(self) -> dict:
        """get_attr target -> the op text that made its gradient Partial."""
        return {t: self.where(c.origin) for t, c in self.params.items() if c.kind == PARTIAL}

    def mixed_params(self) -> dict:
        return {t: c for t, c in self.params.items() if c.kind == MIXED}

    def placement(self, target: str, tp_dim: Optional[int]):
        """The gradient placement of parameter ``target`` (tp_dim: its Shard dim, None when
        replicated): Replicate() / Shard(d) / Partial() / Mixed(); None when unused."""
        c = self.params.get(target)
        if c is None:
            return None
        if c.kind == MIXED:
            return Mixed()
        if c.kind == PARTIAL:
            return Partial()
        return Replicate() if tp_dim is None else Shard(tp_dim)

    def where(self, name: str) -> str:
        """``op at file:line in module`` of node ``name``."""
        node = self.nodes.get(name)
        if node is None:
            return name or "?"
        line = source_line(node)
        mod = module_path(node) or "the root module"
        return f"{op_name(node.target)} ({name}) at {line or 'an unknown line'} in {mod}"


def op_name(target) -> str:
    """An ATen op as torch prints it (``aten.sub.Tensor``); one of our operators (a plain
    function: ``reduce_partial_from_tp``) by its module and name, not its repr's address."""
    if callable(target) and not isinstance(target, torch._ops.OpOverload) and hasattr(
            target, "__qualname__"):
        return f"{target.__module__}.{target.__qualname__}"
    return str(target)


def derive(graph: fx.Graph, fwd: Forward, outputs: Optional[list] = None,
           grad_inputs=frozenset(), place_f: bool = True, forced=frozenset()) -> GradientFlow:
    """Every value's cotangent placement in ``graph`` (see the module docstring).

    Args:
        fwd: the forward model (placements and roles).
        outputs: one :class:`Cot` (or None) per flat output; default: whole for all.
        grad_inputs: names of placeholders that carry a gradient (a later pipeline stage's
            activations); the model's inputs carry none.
        place_f: replicated activations entering sharded compute get an f (``f_edges``)
            instead of a Partial cotangent; False reports them as Partial (the check of a
            rewritten graph, whose f's are already there).
        forced: (producer, reader) edges that get an f although the producer is computed
            from parameters alone (a parameter whose gradient would otherwise be Mixed).
    """
    nodes = list(graph.nodes)
    flow = GradientFlow(nodes={n.name: n for n in nodes})
    carry = carries(nodes, grad_inputs)
    data = _data_dependent(nodes)
    contribs: dict = {}
    out = next(n for n in reversed(nodes) if n.op == "output")
    flat = _flat(out.args[0])
    for i, a in enumerate(flat):
        if isinstance(a, fx.Node) and carry.get(a):
            c = outputs[i] if outputs is not None else _WHOLE
            if c is not None:
                contribs.setdefault(a, []).append(c)
    for n in reversed(nodes):
        pending = contribs.pop(n, None) or []
        for _i, base in written_args(n):
            # a write in place (``copy_`` into a slice of a ``new_empty``: DeepSeek's keys)
            # is read through the tensor it writes: its readers after the write, processed
            # already, give the written value its cotangent when it is whole (a Partial one
            # there, xLSTM's chunk states written step by step into a replicated buffer, is
            # left to the readers of the write itself, as before this rule)
            written = _combine(contribs.get(base), base)
            if written is not None and written.kind == WHOLE:
                pending = pending + [written]
        cot = _combine(pending, n)
        if cot is None:
            continue
        flow.values[n.name] = cot
        if n.op == "get_attr":
            flow.params[n.target] = _combine([flow.params[n.target], cot], n) \
                if n.target in flow.params else cot
        if n.op != "call_function":
            continue
        for a in value_inputs(n):
            if not carry.get(a):
                continue
            c = _contribution(fwd, n, a, cot, data, flow, place_f, forced)
            contribs.setdefault(a, []).append(c)
    flow.inputs = [flow.values.get(n.name) for n in nodes if n.op == "placeholder"]
    return flow


def _contribution(fwd, u, a, cot, data, flow, place_f, forced) -> Cot:
    """The cotangent reader ``u`` (its own cotangent ``cot``) gives its input ``a``."""
    if u.target is operator.getitem or cot.kind == MIXED:
        return cot
    role = fwd.role(u, a)
    if role == "f":
        return _WHOLE if cot.kind == PARTIAL else Cot(
            MIXED, u.name, "an f whose output gradient is already whole (its all-reduce "
                           "counts it tp times)")
    if role == "gather":
        return _gathered(fwd, u, a, cot, flow, place_f)
    if role in ("split", "whole"):
        return _WHOLE if cot.kind == WHOLE else Cot(MIXED, u.name, "a Partial gradient "
                                                    "reaches an op that needs a whole one")
    if role == "after_g":
        return cot
    sharded = fwd.varying(u) or any(fwd.varying_input(u, i) for i in value_inputs(u))
    if not sharded:
        return cot
    if cot.kind != WHOLE:
        return Cot(MIXED, u.name, "a Partial gradient reaches sharded compute")
    if fwd.varying(a):
        return _WHOLE
    if place_f and (data.get(a) or (a.name, u.name) in forced):
        readers = flow.f_edges.setdefault(a.name, [])
        if u.name not in readers:
            readers.insert(0, u.name)  # visited in reverse: keep graph order
        return _WHOLE
    return Cot(PARTIAL, u.name)


def _gathered(fwd, u, a, cot, flow, place_f) -> Cot:
    """The cotangent reader ``u`` gives ``a`` through a planned all-gather: the gathered,
    replicated value gets ``u``'s contribution (in sharded compute, each rank's share:
    Partial), and the gather's backward, the rank's slice, needs it whole. So in sharded
    compute an f goes between the gather and ``u`` (``f(all_gather(a))``): linear attention's
    ``k.unsqueeze(-1) * v.unsqueeze(-2)`` with k sharded and v gathered, whose v gradient sums
    over k's sharded features (zoo 18 Z6: Mixed at the program's check)."""
    if cot.kind != WHOLE:
        return Cot(MIXED, u.name, "a Partial gradient reaches an op that needs a whole one")
    if not (fwd.varying(u) or any(fwd.varying_input(u, i) for i in value_inputs(u))):
        return _WHOLE
    if not place_f:
        return Cot(MIXED, u.name, "a gathered value enters sharded compute: its gradient is "
                                  "each rank's share, which the gather's backward slices")
    readers = flow.f_edges.setdefault(a.name, [])
    if u.name not in readers:
        readers.insert(0, u.name)
    return _WHOLE


def _combine(cots, node) -> Optional[Cot]:
    """All readers' contributions to one value: equal kinds stay; whole + Partial is Mixed."""
    cots = [c for c in cots or () if c is not None]
    if not cots:
        return None
    mixed = next((c for c in cots if c.kind == MIXED), None)
    if mixed is not None:
        return mixed
    partial = next((c for c in cots if c.kind == PARTIAL), None)
    if partial is None:
        return cots[0]
    if all(c.kind == PARTIAL for c in cots):
        return partial
    return Cot(MIXED, partial.origin, f"read both as a whole value and by sharded compute "
                                      f"({partial.origin}), which gives a Partial gradient")


def _flat(x) -> list:
    if isinstance(x, (tuple, list)):
        return [y for v in x for y in _flat(v)]
    return [x]


def _differentiable(n: fx.Node) -> bool:
    v = n.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in vals)


def _holds_tensor(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(
        isinstance(t, torch.Tensor) for t in v))


def carries(nodes, grad_inputs) -> dict:
    """node -> whether a gradient can flow back through it: computed from a trainable
    parameter (or a placeholder in ``grad_inputs``) by differentiable ops."""
    out = {}
    for n in nodes:
        if n.op == "get_attr":
            v = n.meta.get("val")
            out[n] = isinstance(v, torch.Tensor) and v.requires_grad
        elif n.op == "placeholder":
            out[n] = n.name in grad_inputs and _differentiable(n)
        elif n.op == "call_function":
            out[n] = (n.target not in _NO_GRADIENT and _differentiable(n)
                      and any(out.get(a) for a in n.all_input_nodes))
            _mark_written(n, out)
    return out


def _mark_written(n: fx.Node, out: dict) -> None:
    """When ``n`` writes in place a value ``out`` marks (a ``copy_`` of a gradient-carrying
    key into a slice of a ``new_empty``), mark the tensor it writes too, for its readers
    after the write."""
    if out.get(n):
        for _i, base in written_args(n):
            out[base] = True


def _data_dependent(nodes) -> dict:
    """node -> whether its value is computed from a placeholder's tensor (an activation), as
    opposed to parameters, buffers and constants alone."""
    out = {}
    for n in nodes:
        if n.op == "placeholder":
            out[n] = isinstance(n.meta.get("val"), torch.Tensor)
        else:
            out[n] = any(out.get(a) and _holds_tensor(a) for a in n.all_input_nodes)
            _mark_written(n, out)
    return out
