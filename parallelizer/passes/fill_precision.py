"""fill_precision pass: fill values past fp16's range follow the filled tensor's dtype under
``mixed_precision.param_dtype`` bf16 / fp16 (:func:`runtime.precision.in_range_of`).

Capture runs in fp32, so ``scores.masked_fill(~mask, torch.finfo(scores.dtype).min)`` is
captured with fp32's minimum, -3.4e38, as a number in the graph. Under fp16 the program's
scores are fp16, which cannot hold it: every mixed-precision layout of such a model stopped
at its first step (zoo 25 F7), where the model under autocast fills with fp16's minimum.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.graph_facts import aten
from ..runtime.precision import in_range_of

# op -> (index of the tensor whose dtype the value takes, index of the value)
_FILLS = {aten.masked_fill.Scalar: (0, 2), aten.masked_fill_.Scalar: (0, 2),
          aten.fill.Scalar: (0, 1), aten.fill_.Scalar: (0, 1),
          aten.full_like.default: (0, 1), aten.clamp_min.default: (0, 1),
          aten.clamp_max.default: (0, 1)}
_HALF_MAX = torch.finfo(torch.float16).max


def apply_fill_precision(gm: fx.GraphModule, param_dtype: str) -> bool:
    """Rewrite ``gm`` in place when ``param_dtype`` is not fp32; whether anything changed."""
    if param_dtype == "fp32":
        return False
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FILLS:
            continue
        t, i = _FILLS[node.target]
        value = node.args[i] if len(node.args) > i else None
        # a value fp16 holds, an inf, a nan or a computed one: as it is
        if not isinstance(value, float) or not _HALF_MAX < abs(value) < float("inf"):
            continue
        with graph.inserting_before(node):
            fitted = graph.call_function(in_range_of, (node.args[t], value))
        fitted.meta = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack")
                       if k in node.meta}
        node.update_arg(i, fitted)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed
