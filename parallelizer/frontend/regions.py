"""Regions torch.export keeps as subgraphs of a higher-order op, inlined where that keeps
what the model computes, so that every planner and pass reads one flat graph of ATen ops:

- ``torch.no_grad()`` (``wrap_with_set_grad_enabled(False, submod, *args)``): inputs and
  outputs detached, the same values, none of them carrying gradient;

``torch.autocast(device, enabled=False)`` (x-transformers' rotary embedding, kept in fp32 under
mixed precision) never becomes a region: the capture runs with autocast off, where entering
such a region changes nothing, and :func:`autocast_off_elided` makes it the no-op it is there.
torch.export's own region (``wrap_with_autocast``) lost a ``torch.no_grad()`` inside it: its
pass splitting the graph at the region's ends dropped the no_grad's ends, and the ops ran with
gradient. The compiler refuses mixed precision other than fp32 for such a model, whose
autocast would reach into the region (:func:`check_autocast_off`).

An autocast region that turns autocast on, ``torch.cond`` and ``torch.autograd.Function``
stay subgraphs, which capture refuses.
"""
from __future__ import annotations

import contextlib
import operator
import traceback

import torch

from ..errors import CaptureError
from .graph_rewrite import returns_view, written_inputs
from .source_lines import trace_lines

_AUTOCAST_OFF = "autocast_off"  # gm.meta key: the source lines of the elided regions


@contextlib.contextmanager
def autocast_off_elided():
    """Around the capture: ``torch.autocast(device, enabled=False)`` entered where autocast
    is off on ``device`` already is a no-op (it would set the state it finds; only a model
    reading ``torch.get_autocast_dtype`` could tell), so torch.export records no region for
    it (module docstring). Yields the list it appends each such region's model line to
    (``file.py:line``, the innermost frame outside torch and parallelizer), for
    :func:`record_autocast_off`."""
    cls, lines = torch.amp.autocast_mode.autocast, []
    enter, leave = cls.__enter__, cls.__exit__

    def __enter__(self):
        if self._enabled or torch.is_autocast_enabled(self.device):
            return enter(self)
        self._pz_elided = getattr(self, "_pz_elided", 0) + 1  # a decorator's one instance
        lines.append(next(iter(trace_lines("".join(traceback.format_stack()))), "the model"))
        return self

    def __exit__(self, *exc):
        if not getattr(self, "_pz_elided", 0):
            return leave(self, *exc)
        self._pz_elided -= 1
        return False
    cls.__enter__, cls.__exit__ = __enter__, __exit__
    try:
        yield lines
    finally:
        cls.__enter__, cls.__exit__ = enter, leave


def record_autocast_off(gm: torch.fx.GraphModule, lines: list[str]) -> None:
    """Keep the elided autocast-off regions' lines (:func:`autocast_off_elided`) with ``gm``
    for :func:`check_autocast_off`."""
    gm.meta[_AUTOCAST_OFF] = list(dict.fromkeys(lines))


def inline_regions(gm: torch.fx.GraphModule) -> None:
    """Inline ``gm``'s no_grad regions (module docstring)."""
    from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
    graph = gm.graph
    todo = list(graph.nodes)
    while todo:  # a region nested in another is a node of the graph once its outer one is
        inlined = []
        for node in todo:
            if node.op == "call_function" and node.target is wrap_with_set_grad_enabled \
                    and node.args[0] is False:
                inlined += _inline(gm, node, node.args[1], node.args[2:])
        todo = inlined
    graph.lint()
    gm.recompile()


def check_autocast_off(gm: torch.fx.GraphModule, param_dtype: str) -> None:
    """Refuse mixed precision for a model with autocast-off regions elided: the program
    runs each stage's forward under ``torch.autocast(param_dtype)``, which would reach into
    them (the model keeps them in fp32; x-transformers' rotary embedding).

    Raises:
        CaptureError: names the regions' source lines, the spec key and the fix.
    """
    lines = list(gm.meta.get(_AUTOCAST_OFF, ()))
    if param_dtype == "fp32" or not lines:
        return
    raise CaptureError(
        f"the model turns autocast off at {', '.join(lines)} (torch.autocast(..., "
        f"enabled=False)), and mixed_precision.param_dtype={param_dtype} runs every stage "
        f"under torch.autocast({param_dtype}), which the compiled program cannot turn off "
        f"for those ops: they would run in {param_dtype}, not as the model keeps them. Set "
        f"mixed_precision.param_dtype=fp32, or compute that code outside the autocast-off "
        f"region")


def _inline(gm, node, attr, args) -> list:
    """Copy the no_grad subgraph ``attr`` of ``node`` before it, reading ``args``, every
    tensor read and returned detached (a no_grad region's ops, inlined, track no gradient:
    spectral_norm's power iteration writes ``div(..., out=self._u)`` from the weight, which
    raises with gradient tracked; export's fake values do not say which tensors carry
    gradient, so every tensor is detached). A SymInt output (``min(k, x.shape[1])``) is
    passed on as it is. Returns the nodes copied."""
    graph, sub = gm.graph, getattr(gm, attr.target)

    def keep(v):
        return _detach(graph, v) if _is_tensor(v) else v
    env, outs, args, outer, copied = {}, None, iter(args), {}, []
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                outer[n] = next(args)
                env[n] = keep(outer[n])
            elif n.op == "output":
                outs = n.args[0]
            elif n.op == "get_attr":
                got = graph.get_attr(_held_by(gm, sub, n.target))
                got.meta = dict(n.meta)
                env[n] = keep(got)
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
                copied.append(env[n])
        results = [_written_attr(o, outer) or keep(env[o]) if o in env else o for o in outs]
    for user in list(node.users):
        assert user.target is operator.getitem, user  # export unpacks the region's tuple
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if not attr.users:
        graph.erase_node(attr)
        delattr(gm, attr.target)
    return copied


def _held_by(gm, sub, target: str) -> str:
    """The name under which ``gm`` holds what ``sub`` holds at ``target``: a region nested in
    the inlined one is a submodule of ``sub``, not of ``gm`` (zoo 21 F1, then autocast-off
    regions in ring-attention-pytorch's rotary: the copied get_attr named nothing and the
    graph's lint raised), and is registered on ``gm`` under a free name."""
    held = operator.attrgetter(target)(sub)
    try:
        if operator.attrgetter(target)(gm) is held:
            return target
    except AttributeError:
        pass
    base, i = target.replace(".", "_"), 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    setattr(gm, f"{base}_{i}", held)
    return f"{base}_{i}"


def _written_attr(out, outer: dict):
    """The model's parameter or buffer (its get_attr) where the region returns it written in
    place (``with no_grad(): w.copy_(F.normalize(w))``, ``temp.clamp_(0.001, 0.5)``): eager
    then reads the parameter itself, which carries gradient; detached, it got none (zoo 20
    Z7: a max-norm constraint's weight never trained). Else None."""
    while returns_view(out) and written_inputs(out):  # returns the tensor it wrote
        out = written_inputs(out)[0][1]
    got = outer.get(out) if out.op == "placeholder" else None
    return got if isinstance(got, torch.fx.Node) and got.op == "get_attr" else None


def _is_tensor(value) -> bool:
    return isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _detach(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = {**value.meta}
    return out
