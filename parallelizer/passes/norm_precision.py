"""norm_precision pass: a batch norm's weight and bias are cast to its running statistics'
dtype under ``mixed_precision.param_dtype`` bf16 / fp16 (:func:`runtime.precision.in_stats_dtype`).

FSDP2 (ZeRO-2/3) computes in ``param_dtype`` by casting the parameters a unit gathers; the
running mean and variance are buffers and stay fp32. ``aten.batch_norm`` refuses that mix,
so a model with a BatchNorm (a Conformer's convolution module, a CNN) crashed at its first
step under mixed precision on every layout with FSDP2, tp = 1 included (a break test).
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import aten
from ..runtime.precision import in_stats_dtype

# (op, index of its running mean): weight and bias are args 1 and 2 of each
_NORMS = {aten.batch_norm.default: 3, aten._native_batch_norm_legit.default: 3,
          aten._native_batch_norm_legit_no_training.default: 3, aten.instance_norm.default: 3}


def apply_norm_precision(gm: fx.GraphModule, param_dtype: str) -> bool:
    """Rewrite ``gm`` in place when ``param_dtype`` is not fp32; whether anything changed."""
    if param_dtype == "fp32":
        return False
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _NORMS:
            continue
        stats = node.args[_NORMS[node.target]] if len(node.args) > 3 else None
        if not isinstance(stats, fx.Node):
            continue  # no running statistics: weight and input share param_dtype
        for i in (1, 2):
            t = node.args[i] if len(node.args) > i else None
            if not isinstance(t, fx.Node):
                continue
            with graph.inserting_before(node):
                cast = graph.call_function(in_stats_dtype, (t, stats))
            cast.meta = dict(t.meta)
            node.replace_input_with(t, cast)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed
