"""rng_streams pass: each dropout node becomes ``runtime.rng.random_op(stream, op, *args)``,
the same ATen op drawing from the model-parallel stream the planner chose
(``planning/dropout.py``). The node keeps its name, arguments and metadata, so the stage
split, block outlining and the emitted source see the same graph; the stream reads in the
program: ``dropout_1 = rng.random_op('replicated', 'aten.dropout.default', add_3, 0.1, True)``.
"""
from __future__ import annotations

import torch.fx as fx

from ..runtime.rng import random_op


def apply_rng_streams(gm: fx.GraphModule, sites) -> bool:
    """Rewrite the nodes of ``sites`` (DropoutSite) in place; returns whether any changed."""
    by_name = {s.node: s for s in sites}
    changed = False
    for node in gm.graph.nodes:
        site = by_name.get(node.name)
        if site is None:
            continue
        assert node.op == "call_function" and str(node.target) == site.op, (node, site)
        node.target = random_op
        node.args = (site.stream, site.op, *node.args)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
