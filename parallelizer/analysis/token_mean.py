"""Losses that are a mean over a count the inputs decide: a cross-entropy (or nll) averaged
over its non-ignored targets, ``(per_token * mask).sum() / mask.sum()``.

On a batch cut into chunks (dp ranks x microbatches) each chunk's mean divides by its own
count, and the mean of those means is not the whole batch's mean when the counts differ
(labels ``-100`` spread unevenly: padding, prompts masked out). The whole batch's value is
``sum over chunks of the numerators / sum over chunks of the counts``; the counts depend on
the inputs alone, so they can be summed before the step (the fix Hugging Face's
``num_items_in_batch`` makes, and torchtitan's and Megatron-LM's normalisation by the global
token count). A :class:`TokenMeanSite` is such a quotient; it can take the whole batch's count
when every use of its value is linear up to a 0-dim model output (the runtime averages those
over chunks, which then sums the numerators).
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch
import torch.fx as fx

from ..frontend.graph_rewrite import ZEROS
from .graph_facts import aten, descendants, source_line, val
from .writes import written_nodes

# losses reduced by ``reduction`` (arg 3; mean by default) over the targets other than
# ``ignore_index`` (arg 4), weighted by ``weight`` (arg 2)
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
           aten.nll_loss2d.default}
_MEAN, _SUM = 1, 2
# ops through which a 0-dim value stays a constant multiple of its input
_SAME = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
         aten.alias.default, aten.view.default, aten.reshape.default, aten.squeeze.default,
         aten.squeeze.dim, aten.unsqueeze.default, aten.detach.default, aten.neg.default,
         aten.contiguous.default}
_SUMS = {aten.add.Tensor, aten.sub.Tensor, operator.add, operator.sub}
_SCALES = {aten.mul.Tensor, aten.div.Tensor, operator.mul, operator.truediv}
_FULL_SUMS = {aten.sum.default, aten.count_nonzero.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}


class TokenMeanSite(NamedTuple):
    """One quotient whose denominator the inputs decide.

    Attributes:
        node: the loss node (kind "loss": a mean-reduced cross_entropy / nll) or the
            ``aten.div`` node (kind "div").
        kind: "loss" | "div".
        count: the node holding the count: the loss's target (counted where it is not
            ``ignore_index``) or the divisor (a sum over the inputs).
        ignore_index: the loss's ignore_index (kind "loss"; 0 for "div").
        line: the model's source line of ``node`` ('' when export recorded none).
    """
    node: str
    kind: str
    count: str
    ignore_index: int
    line: str


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def reduction(node: fx.Node) -> int:
    return _arg(node, 3, "reduction", _MEAN)


def _from_inputs(node, inputs: set, written: set) -> bool:
    """``node`` is computed from the model inputs ``inputs`` alone, by deterministic ops
    (no parameter, buffer or random draw) on values nothing writes in place afterwards
    (``written``: the counter copies the producers, not the writes), and reads at least one
    of the inputs."""
    todo, seen, reads = [node], set(), False
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n in written:
            return False
        if n.op == "placeholder":
            if n.name not in inputs:
                return False
            reads = True
        elif n.op != "call_function" or (isinstance(n.target, torch._ops.OpOverload)
                                         and torch.Tag.nondeterministic_seeded in n.target.tags):
            return False
        todo += n.all_input_nodes
    return reads


def _strip_casts(node):
    while isinstance(node, fx.Node) and node.target in _CASTS:
        node = node.args[0]
    return node


def _full_sum(node) -> bool:
    """``node`` (through dtype casts) sums every element of its input, is a loss summed over
    its targets (``reduction="sum"``), or adds such sums (a loss computed in sequence chunks,
    ``total = x.new_zeros(()); total = total + ce(chunk, reduction="sum")``): additive over
    row chunks."""
    node = _strip_casts(node)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in _LOSSES:  # reduction="sum": transformers' fixed_cross_entropy
        return reduction(node) == _SUM
    if node.target in (aten.add.Tensor, operator.add):  # chunked: 0 + sum_1 + sum_2 + ...
        return len(node.args) == 2 and not node.kwargs and all(
            _full_sum(a) or _zero(a) for a in node.args) and not all(_zero(a) for a in node.args)
    if node.target in _FULL_SUMS:
        return _arg(node, 1, "dim", None) is None
    if node.target is aten.sum.dim_IntList:
        x = val(node.args[0])
        dims = node.args[1] if len(node.args) > 1 else None
        if not isinstance(x, torch.Tensor) or _arg(node, 2, "keepdim", False):
            return False
        return not dims or len({d % max(x.dim(), 1) for d in dims}) == x.dim()
    return False


def _zero(node) -> bool:
    """``node`` is the number 0 or a tensor of zeros made from nothing else's values."""
    if not isinstance(node, fx.Node):
        return node == 0
    return node.op == "call_function" and node.target in ZEROS


def _zero_dim(node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dim() == 0


def linear_to_outputs(node: fx.Node) -> bool:
    """Every use of ``node``'s 0-dim value is, up to a 0-dim model output, a sum or a
    difference with other values, a scale by a number, a cast or a view: each output is a
    constant multiple of it plus terms that do not read it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                continue
            if user.op != "call_function" or not _zero_dim(user):
                return False
            if user.target in _SCALES:
                other = user.args[1] if user.args[0] is n else user.args[0]
                if isinstance(other, fx.Node) or (user.target in (aten.div.Tensor, operator.truediv)
                                                  and user.args[1] is n):
                    return False
            elif user.target not in _SAME | _SUMS:
                return False
            todo.append(user)
    return _outputs_are_zero_dim(node)


def _outputs_are_zero_dim(node: fx.Node) -> bool:
    """No non-0-dim model output holds ``node``'s value (a 0-dim output is averaged over
    the chunks; one concatenated over rows would hold each chunk's weighted value)."""
    flat = torch.utils._pytree.tree_leaves(node.graph.output_node().args[0])
    reached = descendants(node)
    return all(_zero_dim(o) for o in flat if isinstance(o, fx.Node) and o in reached)


def _loss_site(node: fx.Node, inputs: set, written: set) -> Optional[TokenMeanSite]:
    target = node.args[1]
    t = val(target)
    if (reduction(node) != _MEAN or _arg(node, 2, "weight", None) is not None
            or not isinstance(t, torch.Tensor) or t.is_floating_point()
            or not _from_inputs(target, inputs, written) or not linear_to_outputs(node)):
        return None
    return TokenMeanSite(node.name, "loss", target.name, int(_arg(node, 4, "ignore_index", -100)),
                         source_line(node))


def _div_site(node: fx.Node, inputs: set, written: set) -> Optional[TokenMeanSite]:
    num, den = node.args[0], node.args[1]
    if not (isinstance(num, fx.Node) and isinstance(den, fx.Node) and _zero_dim(node)
            and _zero_dim(den) and _full_sum(num) and _full_sum(den)
            and not _from_inputs(num, inputs, written) and _from_inputs(den, inputs, written)
            and linear_to_outputs(node)):
        return None
    return TokenMeanSite(node.name, "div", den.name, 0, source_line(node))


def token_mean_sites(graph: fx.Graph, input_names) -> list[TokenMeanSite]:
    """The quotients of ``graph`` (as captured) whose denominator is a count over the model
    inputs ``input_names`` and whose value reaches the 0-dim outputs linearly, in graph order."""
    inputs, sites, written = set(input_names), [], written_nodes(graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        site = None
        if node.target in _LOSSES:
            site = _loss_site(node, inputs, written)
        elif node.target in (aten.div.Tensor, operator.truediv):
            site = _div_site(node, inputs, written)
        if site:
            sites.append(site)
    return sites


def only_sites(graph: fx.Graph, sites: list[TokenMeanSite]) -> bool:
    """Every 0-dim floating-point output of ``graph`` is a constant combination of ``sites``
    (through the ops :func:`linear_to_outputs` follows): the program's loss is then the
    whole batch's, whatever the chunks."""
    names = {s.node for s in sites}
    todo = [o for o in torch.utils._pytree.tree_leaves(graph.output_node().args[0])
            if isinstance(o, fx.Node) and _zero_dim(o) and val(o).is_floating_point()]
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen or n.name in names:
            continue
        seen.add(n)
        if n.op != "call_function" or n.target not in _SAME | _SUMS | _SCALES:
            return False
        todo += [a for a in n.args if isinstance(a, fx.Node)]
    return bool(sites)
