"""The forward models :func:`parallelizer.analysis.gradients.derive` reads: per node, whether
its value varies over the tp ranks, and the role each op plays for its inputs' gradients.

- :class:`PlannedForward`: the captured graph under a TPDecision, before any rewrite. A
  value varies when its settled placement (``TPDecision.placements``) is not Replicate; the
  column_parallel linears' inputs have the f the tensor_parallel pass puts before them (role
  "whole"; their biases are sharded with them), a parameter varies when the decision shards
  it (``dims``; a transpose of a sharded weight too), a row_parallel linear's bias is added after its g (role "after_g"), and a value
  cut to each rank's heads (``TPDecision.narrows``) is replicated compute followed by a
  scatter (role "split"). A redistribution (``TPDecision.redistributions``) is on its
  edges: a reader of a gathered value reads it whole (role "gather", not varying there), a
  reader of a cut one reads the rank's block (role "split", varying there); a reduced
  Partial output is whole (its placement is Replicate).
- :class:`ProgramForward`: the rewritten stage graphs, from the plan alone. A parameter
  varies when the plan shards it (``tp_dim``); an op's value varies when an input does,
  except at the operators that make it whole again (g, the gathers, the vocab-parallel loss)
  and where one cuts a replicated value (scatter, the sequence-parallel split). The f
  operators (``copy_to_tp_region``, the sequence-parallel all-gather) have role "f", the
  cuts "split".
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime import sequence as sp
from ..runtime.tp import (copy_to_tp_region, gather_from_tp_dim, reduce_from_tp_region,
                          reduce_partial_from_tp, scatter_copies_to_tp_region,
                          scatter_pieces_to_tp_region, scatter_to_tp_region)
from ..runtime.vocab import gather_from_tp_region, vocab_parallel_lookup
from ..runtime.vocab_loss import vocab_parallel_cross_entropy
from .graph_facts import aten
from .linears import bias_operand, linear_sites
from .sharding.placements import CopiedWhole, PerOutput, Replicate

# operators whose output is the same on every tp rank whatever their inputs
_WHOLE_OUTPUT = {reduce_from_tp_region, gather_from_tp_region, vocab_parallel_cross_entropy,
                 gather_from_tp_dim, reduce_partial_from_tp,
                 sp.all_gather_from_sequence_parallel_region,
                 sp.gather_from_sequence_parallel_region}
# operators whose output is this rank's piece of a replicated input
_CUTS = {scatter_to_tp_region, scatter_copies_to_tp_region, scatter_pieces_to_tp_region,
         sp.split_to_sequence_parallel_region}
_RANK_OUTPUT = _CUTS | {sp.reduce_scatter_to_sequence_parallel_region, vocab_parallel_lookup,
                        sp.gathered_linears, sp.random_op_on_sequence_shard}
_F = {copy_to_tp_region, sp.all_gather_from_sequence_parallel_region}


def varies(p) -> bool:
    """A forward placement other than Replicate (None: a node propagation did not place);
    a copy held whole whose gradient is Partial (:class:`CopiedWhole`) varies too."""
    if isinstance(p, CopiedWhole):
        return True
    if p is None or isinstance(p, Replicate):
        return False
    if isinstance(p, PerOutput):
        return any(varies(o) for o in p.outputs)
    return True  # Shard, or a Conflict (the planner has removed every one it kept)


class PlannedForward:
    """The captured graph under ``decision`` (a TPDecision), before the passes."""

    def __init__(self, graph: fx.Graph, decision):
        self.placements = decision.placements
        self.narrows = set(decision.narrows)
        self.gathered, self.cut = set(), set()
        for r in decision.redistributions:
            edges = {(u, r.producer) for u in r.readers}
            if r.kind == "all_gather":
                self.gathered |= edges
            elif r.kind in ("scatter", "scatter_copies", "scatter_pieces"):
                self.cut |= edges
        self.sharded = set(decision.dims)  # parameters the plan shards (column biases too)
        self.column_in, self.row_bias, self.weight_views = {}, {}, set()
        for site in linear_sites(graph):
            if site.weight not in decision.column and site.weight not in decision.row:
                continue
            if site.w_node is not None and site.w_node.op == "call_function":
                self.weight_views.add(site.w_node)  # W.T of a sharded W (propagation: R)
            if site.weight in decision.column:
                # the planned f before it; its bias inside the op is sharded with it
                self.column_in[site.node] = {site.x} | (
                    {bias_operand(site)} if site.bias and site.bias_add is None else set())
            elif site.weight in decision.row and site.bias and site.bias_add is None:
                bias = site.node.args[0] if site.node.target is aten.addmm.default else \
                    site.node.args[2]
                self.row_bias[site.node] = bias

    def varying(self, node: fx.Node) -> bool:
        return node in self.weight_views or varies(self.placements.get(node.name)) or (
            node.op == "get_attr" and node.target in self.sharded)

    def varying_input(self, node: fx.Node, arg: fx.Node) -> bool:
        if (node.name, arg.name) in self.gathered:
            return False
        return (node.name, arg.name) in self.cut or self.varying(arg)

    def role(self, node: fx.Node, arg: fx.Node) -> str:
        if arg in self.column_in.get(node, ()):
            return "whole"
        if (node.name, arg.name) in self.gathered:
            return "gather"
        if (node.name, arg.name) in self.cut:
            return "split"
        if self.row_bias.get(node) is arg:
            return "after_g"
        if node.name in self.narrows:
            return "split"
        return "compute"


class ProgramForward:
    """The rewritten stage graphs of ``plan`` (placements from the plan and the operators);
    call :meth:`run` on each stage graph in pipeline order."""

    def __init__(self, plan):
        self.plan = plan
        self._varies: dict = {}

    def _sharded(self, target: str) -> bool:
        fqn = self.plan.aliases.get(target, target)
        t = self.plan.tensors.get(fqn)
        return t is not None and t.tp_dim is not None

    def run(self, graph: fx.Graph, inputs_vary: list) -> list:
        """Place ``graph``'s nodes (its placeholders vary as ``inputs_vary`` says, in order);
        returns whether each flat output varies."""
        phs = iter(inputs_vary)
        for n in graph.nodes:
            if n.op == "placeholder":
                self._varies[n] = bool(next(phs, False))
            elif n.op == "get_attr":
                self._varies[n] = self._sharded(n.target)
            elif n.op == "call_function":
                self._varies[n] = self._rule(n)
            elif n.op == "output":
                flat = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                return [isinstance(a, fx.Node) and self._varies.get(a, False) for a in flat]
        return []

    def _rule(self, n: fx.Node) -> bool:
        if n.target in _WHOLE_OUTPUT:
            return False
        if n.target in _RANK_OUTPUT:
            return True
        if n.target is operator.getitem or _tensor_valued(n):
            return any(self._varies.get(a, False) for a in value_inputs(n))
        return False

    def varying(self, node: fx.Node) -> bool:
        return self._varies.get(node, False)

    def varying_input(self, node: fx.Node, arg: fx.Node) -> bool:
        return self.varying(arg)

    def role(self, node: fx.Node, arg: fx.Node) -> str:
        if node.target in _F:
            return "f"
        if node.target in _CUTS:
            return "split"
        return "compute"


# ops that read an argument for its dtype alone (``x.type_as(other)``, ``x.to(other)``): no
# value or shape of it reaches the output, and no gradient reaches it
_DTYPE_ONLY_ARG = {aten.type_as.default: 1, aten.to.other: 1}


def value_inputs(u: fx.Node) -> list:
    """The inputs of ``u`` whose values its output depends on (not ``other`` of
    ``x.type_as(other)``: Performer's ``repeat(proj, ...).type_as(k)`` of a replicated
    buffer does not vary with the rank's heads of ``k``)."""
    k = _DTYPE_ONLY_ARG.get(u.target)
    skip = u.args[k] if k is not None and len(u.args) > k else None
    return [a for a in u.all_input_nodes if a is not skip]


def _tensor_valued(n: fx.Node) -> bool:
    v = n.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) for t in vals)
