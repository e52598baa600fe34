"""Channel maps as linears (issue 23: "a conv over channels ... the block still shards its
large matmuls"):

- a pointwise convolution, ``conv1d/2d/3d(x, W, b)`` with every kernel size, stride and
  dilation 1, no padding, one group and a batched input (``x`` (N, C, *S), W (O, C, 1..)),
  is the linear map of the channel dim it computes: it is rewritten on the captured graph
  into ``linear(x.permute(0, *S, 1), W.view(O, C), b).permute(0, -1, *S)``, made
  contiguous where the conv's output is (torchaudio's ConvTasNet ``view``s a product with it,
  which fails on the permuted strides, zoo 22 F7) (Conformer's and
  ConvNeXt-style pointwise convs, a 1x1 conv of a ResNet bottleneck). The tensor-parallel
  planner then finds it as it finds ``nn.Linear``: the weight path's view merges W's trailing
  dims into its input features, so a column_parallel W is sharded along dim 0 and a
  row_parallel one along dim 1, its FQN and shape kept;
- ``glu(x, dim)`` is rewritten into what ATen defines it as, ``a, b = x.split(n // 2, dim);
  a * sigmoid(b)``: a linear before it is then a fused column (``layout fused``) as for a
  ``chunk(2)`` gated MLP, where no rule takes ``aten.glu`` over a sharded dim.

A convolution with a kernel wider than 1 is left as it is (its weight replicated unless its
channels arrive sharded and its groups split with them:
:mod:`parallelizer.analysis.sharding.channels`). Every node added carries the rewritten
node's meta (module, source line) and a FakeTensor value. The rewrite is exact up to the
order of the channel sum, which the conv and the linear kernels need not share (fp32
rounding).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_rewrite import caller, is_param, val

aten = torch.ops.aten

_CONVS = {aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv3d.default: 3}
_CONV_PADDING = {aten.conv1d.padding: 1, aten.conv2d.padding: 2, aten.conv3d.padding: 3}


def channel_maps_as_linears(gm: fx.GraphModule) -> int:
    """Rewrite every pointwise convolution and every ``glu`` of ``gm`` (see the module
    docstring); returns how many."""
    params = {name for name, _ in gm.named_parameters()}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _pointwise(node, params):
            _conv_as_linear(gm.graph, node)
            done += 1
        elif node.target is aten.glu.default and isinstance(val(node.args[0]), torch.Tensor) \
                and not node.kwargs:
            _glu_as_halves(gm.graph, node)
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _ints(v, n: int) -> list:
    return list(v) * (n if len(v) == 1 else 1) if isinstance(v, (list, tuple)) else [v] * n


def _pointwise(node: fx.Node, params: set) -> bool:
    """``node`` is a pointwise convolution of a batched input by a parameter."""
    k = _CONVS.get(node.target) or _CONV_PADDING.get(node.target)
    if k is None or node.kwargs or len(node.args) < 2:
        return False
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    vx, vw = val(x), val(w)
    if not isinstance(vx, torch.Tensor) or not isinstance(vw, torch.Tensor) \
            or vx.dim() != k + 2 or vw.dim() != k + 2 or not is_param(w, params) \
            or b is not None and not (isinstance(b, fx.Node) and is_param(b, params)):
        return False
    stride, padding, dilation, groups = (list(node.args[3:7]) + [1, 0, 1, 1][len(node.args[3:7]):])
    zero_pad = padding in ("same", "valid") if node.target in _CONV_PADDING \
        else _ints(padding, k) == [0] * k
    return zero_pad and _ints(stride, k) == [1] * k and _ints(dilation, k) == [1] * k \
        and groups == 1 and all(s == 1 for s in vw.shape[2:]) and vx.dtype == vw.dtype


def _conv_as_linear(graph: fx.Graph, node: fx.Node) -> None:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    rank = val(x).dim()
    to_last = [0, *range(2, rank), 1]
    back = [0, rank - 1, *range(1, rank - 1)]
    out, cin = (int(s) for s in val(w).shape[:2])
    call = caller(graph, node, [val(x), val(w)])
    with graph.inserting_before(node):
        xs = call(aten.permute.default, x, to_last)
        w2 = call(aten.view.default, w, [out, cin])
        y = call(aten.linear.default, xs, w2, b) if b is not None \
            else call(aten.linear.default, xs, w2)
        y = call(aten.permute.default, y, back)
        if val(node).is_contiguous():  # as the conv's output is: a view after it needs it
            y = call(aten.contiguous.default, y)
    node.replace_all_uses_with(y)
    graph.erase_node(node)


def _glu_as_halves(graph: fx.Graph, node: fx.Node) -> None:
    x = node.args[0]
    dim = (node.args[1] if len(node.args) > 1 else -1) % val(x).dim()
    half = val(x).shape[dim] // 2
    call = caller(graph, node, [val(x)])
    with graph.inserting_before(node):
        parts = call(aten.split.Tensor, x, half, dim)
        a = call(operator.getitem, parts, 0)
        g = call(operator.getitem, parts, 1)
        y = call(aten.mul.Tensor, a, call(aten.sigmoid.default, g))
    node.replace_all_uses_with(y)
    graph.erase_node(node)
