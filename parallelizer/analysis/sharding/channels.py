"""Ops over channels that arrive sharded (issue 23: "a conv over channels ... the block still
shards its large matmuls"): between a pointwise conv read as a column linear and one read
as a row linear (``frontend/conv.py``), Conformer's convolution module runs a depthwise
conv and a BatchNorm over the channels, and a diffusion UNet's or a ConvNeXt's blocks a
grouped conv or a GroupNorm. Each computes every channel group from that group alone, so a
rank holding a block of whole groups computes its block of the output: the channel-sharded
value flows through, and the op's per-channel parameters (conv weight and bias, norm weight,
bias and running statistics) are sharded along their channel dim 0 with it, as per-head
tensors are (:mod:`.heads`: asked for by one run, sharded by the next).

- ``conv{1,2,3}d(x, W, b, stride, padding, dilation, groups)``, ``x`` (N, C, *S) sharded on
  N (Primer-EZ's depthwise conv over ``x.view(batch * heads, d_k, seq)``, the heads sharded):
  each sample is convolved alone, so the output is sharded on N with W and b replicated
  (their gradients then Partial, :mod:`..gradients`). ``x`` sharded evenly on C, tp dividing
  ``groups``: W (C_out, C / groups, *k) and b sharded on dim 0, the output on its channels,
  ``groups`` made the rank's ``groups / tp``. A conv of one group (each output channel
  reads every input channel) is a CONFLICT: the next run gathers;
- ``batch_norm(x, weight, bias, running_mean, running_var, ...)`` over channels (dim 1):
  a channel's statistics are over the batch and spatial dims only, so a rank's block of
  channels is normalised, and its running statistics updated, from its block alone;
- ``instance_norm`` (the same arguments): statistics per sample and channel;
- ``group_norm(x, G, weight, bias, eps)`` with tp dividing G: a group's statistics are over
  its own channels; ``G`` made ``G / tp``.

Source: Megatron-LM's column/row split (Shoeybi et al. 2019, §3) carried along the channel
dim, as channel-parallel CNN training does (Dryden et al., "Channel and filter parallelism
for large-scale CNN training", SC'19, §3).
"""
from __future__ import annotations

from ..graph_facts import aten, is_tensor, module_path, shape
from .heads import even_split, request_heads
from .placements import CONFLICT, Shard
from .state import add_constraint, add_rewrite, dim_of, inputs_of

CONVS = frozenset({aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                   aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding})


_READERS = CONVS | {aten.batch_norm.default, aten.instance_norm.default, aten.group_norm.default}
_PATH = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
         aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.clone.default}


def channel_reader(param):
    """The conv or norm over channels that reads ``param`` (directly or through squeezes
    and casts: Mamba's ``w.squeeze(1).unsqueeze(1)``), or None: a per-channel tensor, named
    so in the messages instead of "per-head"."""
    todo, seen = [param], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target in _READERS:
                return u
            if u.target in _PATH:
                todo.append(u)
    return None


def grouped_conv_rule(node, prop, tp):
    """A convolution over channels sharded along whole groups (see the module docstring)."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    groups = node.args[6] if len(node.args) > 6 else 1
    channel = len(shape(x)) - (len(shape(w)) - 2) - 1  # 0 for an unbatched input
    if channel == 1 and dim_of(prop, x) == 0 and not _copies(prop, x) and all(
            dim_of(prop, p) is None for p in (w, b) if is_tensor(p)):
        return Shard(0)  # each sample alone: a rank's samples (Primer's batch x heads merge)
    return _per_channel(node, prop, tp, channel, [w, b], (groups, 6, "groups"))


def _copies(prop, x) -> bool:
    """``x``'s sharded dim holds copies (kv heads fewer than tp, or expanded), which only the
    rules that keep head marks carry on."""
    mark = prop.heads.get(x.name)
    return mark is not None and (mark.replicated or mark.expanded)


def batch_norm_rule(node, prop, tp):
    """``batch_norm`` or ``instance_norm`` over channels sharded on dim 1 (see the module
    docstring)."""
    return _per_channel(node, prop, tp, 1, node.args[1:5], None)


def group_norm_rule(node, prop, tp):
    """``group_norm`` over channels sharded on dim 1 along whole groups."""
    return _per_channel(node, prop, tp, 1, node.args[2:4], (node.args[1], 1, "groups"))


def _per_channel(node, prop, tp: int, channel: int, params, groups):
    """Shard(channel) when ``node``'s input is an even split of its channels (a column
    output's raw features too: this use of them is recorded as even) and each tensor
    of ``params`` is sharded on dim 0; the replicated ones are asked for (CONFLICT this run).
    ``groups``: (count, argument index, its name) of channel groups tp must divide, the
    argument made local, or None."""
    x = node.args[0]
    if channel < 0 or dim_of(prop, x) != channel or not even_split(prop, x, raw=True):
        return CONFLICT
    if groups is not None:
        count, at, what = groups
        if not isinstance(count, int):
            return CONFLICT
        add_constraint(prop, count, what, module_path(node), f"the {what} of {node.target}")
        if count % tp:
            return CONFLICT
    params = [p for p in params if is_tensor(p)]
    whole = [p for p in params if dim_of(prop, p) is None]
    for p in whole:
        request_heads(prop, p, 0, frozenset().union(
            *[prop.groups.get(a.name, frozenset()) for a in inputs_of(node)]))
    if whole or any(dim_of(prop, p) != 0 for p in params):
        return CONFLICT
    if groups is not None:
        add_rewrite(prop, node, groups[1], None, groups[0] // tp)
    return Shard(channel)
