"""recompute_writes pass: under activation checkpointing, the forward's writes of buffers
run once per step, not again in the recompute (:mod:`parallelizer.runtime.recompute`).

``aten.batch_norm`` becomes ``recompute.batch_norm`` (its running statistics are written
inside the op), and an in-place op whose written argument is a buffer
(``num_batches_tracked.add_(1)``; found by the op's schema, as ``written_attrs`` finds them)
becomes ``recompute.write_once("add_.Tensor", ...)``. Parameters are not buffers: a forward
writing a parameter is refused before this (``check_parameter_writes``).
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import aten
from ..analysis.writes import written_buffer_args
from ..runtime import recompute


def apply_recompute_writes(gm: fx.GraphModule, mode: str) -> bool:
    """Rewrite ``gm`` in place when activation checkpointing is on (``mode`` not "none");
    whether anything changed."""
    if mode == "none":
        return False
    graph, changed = gm.graph, False
    buffers = {name for name, _ in gm.named_buffers()}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.batch_norm.default:
            node.target = recompute.batch_norm
            changed = True
        elif written_buffer_args(node, buffers) == [0]:
            op = node.target
            node.target = recompute.write_once
            node.args = (f"{op._opname}.{op._overloadname}", *node.args)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed
