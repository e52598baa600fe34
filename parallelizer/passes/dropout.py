"""rng_streams pass: each dropout node becomes ``runtime.rng.random_op(stream, op, *args)``,
the same ATen op drawing from the model-parallel stream the planner chose
(``planning/dropout.py``), and so does every other random op (a drop path's ``torch.rand``,
Gumbel noise); one whose output is sharded over tp becomes
``runtime.sequence.random_op_on_tp_shard(stream, op, dim, *args)`` (the full draw, this
rank's block kept). The node keeps its name, arguments and metadata, so the stage split,
block outlining and the emitted source see the same graph; the stream reads in the
program: ``dropout_1 = rng.random_op('replicated', 'aten.dropout.default', add_3, 0.1, True)``.
"""
from __future__ import annotations

import torch.fx as fx

from ..runtime.rng import random_op
from ..runtime.sequence import random_op_on_tp_shard


def apply_rng_streams(gm: fx.GraphModule, sites) -> bool:
    """Rewrite the nodes of ``sites`` (DropoutSite, RandomSite) in place; returns whether
    any changed."""
    by_name = {s.node: s for s in sites}
    changed = False
    for node in gm.graph.nodes:
        site = by_name.get(node.name)
        if site is None:
            continue
        assert node.op == "call_function" and str(node.target) == site.op, (node, site)
        dim = getattr(site, "dim", None)
        if dim is None:
            node.target, node.args = random_op, (site.stream, site.op, *node.args)
        else:
            node.target, node.args = random_op_on_tp_shard, (site.stream, site.op, dim, *node.args)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
