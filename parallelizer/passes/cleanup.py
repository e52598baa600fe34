"""cleanup pass: make the captured graph device-agnostic and free of capture-time checks.

export records the capture device in factory ops (``arange(..., device=cpu)``) and inserts
``_assert_tensor_metadata`` checks naming it; the emitted program runs on whatever device
its rank owns (cuda:LOCAL_RANK under NCCL), so device constants read the module's
``runtime_device`` attribute instead, and the checks go.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..analysis.graph_facts import RUNTIME_DEVICE, aten


def apply_cleanup(gm: fx.GraphModule) -> bool:
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
            changed = True
    device_node = None
    for node in list(graph.nodes):
        is_dev = [isinstance(a, torch.device) for a in node.args]
        if node.op != "call_function" or not (any(is_dev) or isinstance(node.kwargs.get("device"), torch.device)):
            continue
        if device_node is None:
            if not hasattr(gm, RUNTIME_DEVICE):
                setattr(gm, RUNTIME_DEVICE, torch.device("cpu"))
            with graph.inserting_before(_first_non_input(graph)), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a plain attribute, set on every emitted module
                device_node = graph.get_attr(RUNTIME_DEVICE)
        node.args = tuple(device_node if d else a for a, d in zip(node.args, is_dev))
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device_node}
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _first_non_input(graph: fx.Graph) -> fx.Node:
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr"):
            return node
    return graph.output_node()
