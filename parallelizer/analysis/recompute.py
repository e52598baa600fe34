"""Values a pipeline stage recomputes instead of receiving from the stage before.

A value is *recomputable* when it depends only on non-trainable attributes (buffers such as
rotary ``inv_freq``, the runtime device), literal constants and symbolic sizes
(``sym_size`` of a tensor: its shape, not its values), through deterministic ops that
mutate nothing, and that nothing writes in place afterwards (``mask = ones(b, t);
mask[:, :k] = 0``: a copy of ``ones`` in a later stage missed the write, and the loss read an
all-ones mask; analysis/writes.py ``written_nodes``): HF Llama's causal mask (b x 1 x s x s)
and rotary cos/sin (b x s x head_dim). Sending them costs pipeline bandwidth that grows with s^2; each stage that uses
one copies its producer chain instead, as torchtitan's stages recompute them
(torchtitan ``models/llama3/model.py``: every stage rebuilds ``freqs_cis``).
Values derived from a model input's or an activation's values (MiniLM's extended attention
mask) are still sent. ``split_stages`` and the cost model (``graph_costs._cut_bytes``) both
ask ``sent`` which crossing tensors are sent, so the bytes costed are the bytes sent.
"""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.fx as fx

from ..runtime import rng, sequence
from .graph_facts import RUNTIME_DEVICE, aten, expr, is_tensor
from .writes import written_nodes

# the draws the rng_streams pass makes of random ATen ops: a second stage's copy would draw
# again (another value), and the plan, made on the ATen op, has the value sent
_DRAWS = {rng.random_op, sequence.random_op_on_tp_shard, sequence.random_op_on_sequence_shard}


class Recompute:
    """Which nodes of ``graph`` are recomputable, and the sizes (sympy expressions) each
    needs from a local tensor carrying them (its ``sym_size`` roots)."""

    def __init__(self, graph: fx.Graph):
        self.needs: dict = {}   # recomputable node -> frozenset of size expressions
        gm = graph.owning_module
        written = written_nodes(graph)
        for n in graph.nodes:
            need = None if n in written else self._needs(n, gm)
            if need is not None:
                self.needs[n] = need

    def __contains__(self, node) -> bool:
        return node in self.needs

    def sent(self, crossing: list) -> list:
        """The tensors of ``crossing`` (defined before a cut, used after it) that must be
        sent: all but the recomputable ones whose sizes some sent tensor's shape carries
        (``split_stages._rematerialize`` reads a size from a local tensor)."""
        kept = [n for n in crossing if n not in self.needs]
        carried = {expr(s) for n in kept if is_tensor(n) for s in n.meta["val"].shape}
        return [n for n in crossing if n not in self.needs or not self.needs[n] <= carried]

    def readers(self, node: fx.Node) -> set:
        """The nodes that read ``node`` directly or through recomputable values: the stages
        holding them read ``node`` (each copies the chain from ``node`` to its use)."""
        out, todo = set(), list(node.users)
        while todo:
            u = todo.pop()
            if u not in out:
                out.add(u)
                if u in self.needs:
                    todo.extend(u.users)
        return out

    def _needs(self, n: fx.Node, gm):
        if n.op == "get_attr":
            return frozenset() if not _trainable(gm, n) else None
        if n.op != "call_function":
            return None
        if n.target is aten.sym_size.int:
            return frozenset({expr(n.meta["val"])})
        op = n.target
        if op in _DRAWS or isinstance(op, torch._ops.OpOverload) and (
                op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags):
            return None
        out = frozenset()
        for a in n.all_input_nodes:
            if a not in self.needs:
                return None
            out |= self.needs[a]
        return out


def _trainable(gm, node: fx.Node) -> bool:
    """Whether a get_attr reads a parameter (or anything autograd tracks); the device
    attribute and buffers are not."""
    if node.target == RUNTIME_DEVICE:
        return False
    try:
        t = attrgetter(node.target)(gm)
    except AttributeError:  # no module to ask (a bare graph): assume the worst
        return True
    if not isinstance(t, torch.Tensor):
        return False
    return isinstance(t, torch.nn.Parameter) or t.requires_grad
