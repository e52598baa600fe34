"""Einsum projections as linears: ``einsum(eq, x, W)`` with W a parameter, when the
equation is a linear map of some dims of ``x`` by W, is rewritten on the captured graph into
the ``aten.linear`` it computes, on views of W and ``x``:

- ``"bsd,ed->bse"``: ``linear(x, W)``; ``"bsd,de->bse"``: ``linear(x, W.t())``;
- ``"bsd,hkd->bshk"`` (a per-head input projection, W (H, D_h, D)):
  ``linear(x, W.reshape(H * D_h, D)).view(b, s, H, D_h)``, and a permute when the equation
  puts the heads elsewhere (``"bsd,hkd->bhsk"``);
- ``"bhsk,hkd->bsd"`` (a per-head output projection):
  ``linear(x.permute(0, 2, 1, 3).reshape(b, s, H * D_h), W.reshape(H * D_h, D).t())``.

So the tensor-parallel planner finds them as it finds ``nn.Linear`` (``analysis/linears``
``Linear``, whose weight path accepts W's merge of its leading or trailing dims and its
casts), pairs them column/row and shards W along its first dim of the merged group; the
parameter keeps its FQN and shape. The equation is read by its letters' roles, never their
names: each letter of W is either contracted with ``x`` (in both, not in the output) or an
output feature (in W and the output only); each letter of ``x`` not in W is a batch letter
and reaches the output; W's contracted and feature letters are each one contiguous run
(``[features][contracted]`` is W stored (out, in), ``[contracted][features]`` (in, out)).
An einsum of two activations that is a batched matrix product (attention's scores and
context written as ``einsum('b i d, b j d -> b i j', q, k)`` and ``einsum('b i j, b j d ->
b i d', attn, v)``, CompVis ldm's CrossAttention: batch letters in all three operands, one
contracted letter, free letters of each operand) becomes the ``aten.matmul`` of its
operands permuted to ``(batch.., i, d)`` and ``(batch.., d, j)``, permuted back to the
output's order: the sharding rules take it as they take ``q @ k.transpose(-2, -1)`` (no
rule takes ``aten.einsum`` itself, so such an attention and its q/k/v/out projections
were kept replicated). With a parameter for an operand, several free letters of an
operand are folded into one dim first and unfolded after, as torch's own einsum does
before its bmm: an expert-choice MoE's ``einsum('becd,edf->becf', tokens, w1)`` becomes E
linears side by side, the ``matmul`` of (E, rows, in) by a 3-D weight, which
``analysis/linears.py`` shards as it does ``nn.Linear``. Two activations stay an
einsum then, whose own rule (``analysis/sharding/einsum_read.py``) keeps each letter's
shard (PaLM's one k head against the query heads, ``'bhid,bjd->bhij'``).
Any other einsum (a sum over a dim of one operand, a diagonal, several contracted
letters) is left as it is, and the planner reports its weight replicated.

W is a parameter read directly or through casts (``w.to(torch.bfloat16).to(x.dtype)``).
Every node the rewrite adds carries the einsum's meta (module, source line) and a FakeTensor
value.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from .graph_rewrite import ZEROS, caller, is_param, swaps_last_two, val

aten = torch.ops.aten

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def einsums_as_linears(gm: fx.GraphModule) -> int:
    """Rewrite every einsum projection of ``gm`` (see the module docstring); returns how
    many."""
    params = {name for name, _ in gm.named_parameters()}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.einsum.default:
            plan = _projection(node, params)
            if plan is not None:
                _rewrite(gm.graph, node, *plan)
                done += 1
            elif _batched_matmul(gm.graph, node, params):
                done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _batched_matmul(graph: fx.Graph, node: fx.Node, params: set) -> bool:
    """Rewrite ``einsum(eq, a, b)`` into ``matmul`` of permutes when ``eq`` is a batched
    matrix product (see the module docstring); False (left as it is) otherwise."""
    if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], str) \
            or len(node.args[1]) != 2 or not all(isinstance(t, fx.Node) for t in node.args[1]):
        return False
    a, b = node.args[1]
    va, vb = val(a), val(b)
    eq = node.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq or not isinstance(va, torch.Tensor) \
            or not isinstance(vb, torch.Tensor):
        return False
    ins, os_ = eq.split("->")
    if ins.count(",") != 1:
        return False
    as_, bs = ins.split(",")
    if len(set(as_)) != len(as_) or len(set(bs)) != len(bs) or len(set(os_)) != len(os_) \
            or len(as_) != va.dim() or len(bs) != vb.dim() or not set(os_) <= set(as_ + bs):
        return False
    batch = [c for c in os_ if c in as_ and c in bs]
    contracted = [c for c in as_ if c in bs and c not in os_]
    free_a = [c for c in as_ if c not in bs]
    free_b = [c for c in bs if c not in as_]
    if len(contracted) != 1 or not free_a or not free_b \
            or not set(free_a + free_b) <= set(os_) \
            or any(str(va.shape[as_.index(c)]) != str(vb.shape[bs.index(c)])
                   for c in batch + contracted):
        return False
    folded = len(free_a) > 1 or len(free_b) > 1
    if folded and not (is_param(a, params) or is_param(b, params)):
        return False  # two activations: the einsum rule keeps their letters apart
    call = caller(graph, node, [va, vb])
    meta = {k: v for k, v in node.meta.items() if k != "val"}

    def permuted(x, letters, order):
        perm = [letters.index(c) for c in order]
        return x if perm == list(range(len(perm))) else call(aten.permute.default, x, perm)

    def size(c):  # a letter's size: an int, or the sym_size node reading it
        x, letters = (a, as_) if c in as_ else (b, bs)
        s = val(x).shape[letters.index(c)]
        if not isinstance(s, torch.SymInt):
            return int(s)
        n = graph.call_function(aten.sym_size.int, (x, letters.index(c)))
        n.meta = {**meta, "val": s}
        return n

    with graph.inserting_before(node):
        xa = permuted(a, as_, batch + free_a + contracted)
        xb = permuted(b, bs, batch + contracted + free_b)
        if folded:
            # several free letters of an operand (an expert's tokens "becd,edf->becf"): one
            # dim, as torch's own einsum folds them before its bmm
            lead, k = [size(c) for c in batch], size(contracted[0])
            if len(free_a) > 1:
                xa = call(aten.reshape.default, xa, lead + [-1, k])
            if len(free_b) > 1:
                xb = call(aten.reshape.default, xb, lead + [k, -1])
        y = call(aten.matmul.default, xa, xb)
        if folded:
            y = call(aten.reshape.default, y, lead + [size(c) for c in free_a + free_b])
        y = permuted(y, batch + free_a + free_b, list(os_))
    node.replace_all_uses_with(y)
    graph.erase_node(node)
    return True





def _equation(eq: str, x_rank: int) -> Optional[tuple[str, str, str]]:
    """(x's letters, W's letters, output letters) of a two-operand equation, an ellipsis
    (in ``x`` and the output only) spelled as fresh letters; None when it is not one."""
    eq = eq.replace(" ", "")
    if eq.count(",") != 1:
        return None
    ins, arrow, out = eq.partition("->")
    xs, ws = ins.split(",")
    if "." in ws:
        return None
    if not arrow:  # implicit output: the letters seen once, sorted
        letters = (xs + ws).replace(".", "")
        out = ("..." if "..." in xs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    if "..." in xs or "..." in out:
        if xs.count("...") != 1 or out.count("...") != 1:
            return None
        free = [c for c in _LETTERS if c not in eq]
        n = x_rank - (len(xs) - 3)
        if n < 0 or n > len(free):
            return None
        fill = "".join(free[:n])
        xs, out = xs.replace("...", fill), out.replace("...", fill)
    if not all(s.isalpha() for s in (xs, ws, out) if s) or any(
            len(set(s)) != len(s) for s in (xs, ws, out)) or len(xs) != x_rank:
        return None
    return xs, ws, out


def _runs(ws: str, contracted: set) -> Optional[bool]:
    """True when W is ``[features][contracted]`` (stored (out, in)), False for
    ``[contracted][features]``, None when the two kinds of letters interleave."""
    kinds = [c in contracted for c in ws]
    if kinds == sorted(kinds):
        return True
    if kinds == sorted(kinds, reverse=True):
        return False
    return None


def _projection(node: fx.Node, params: set):
    """(x, W, x's letters, W's letters, output letters, out_first) when ``node`` is an
    einsum projection (see the module docstring), else None."""
    if len(node.args) < 2 or node.kwargs or len(node.args) > 2 and node.args[2] is not None:
        return None
    eq, operands = node.args[0], node.args[1]
    if not isinstance(eq, str) or len(operands) != 2 or not all(
            isinstance(val(o), torch.Tensor) for o in operands):
        return None
    which = [is_param(o, params) for o in operands]
    if which.count(True) != 1:
        return None
    wi = which.index(True)
    x, w = operands[1 - wi], operands[wi]
    if val(x).dtype != val(w).dtype or not val(x).is_floating_point():
        return None
    ins, arrow, out = eq.replace(" ", "").partition("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    if wi == 0:  # the weight first: the same map with the operands swapped
        eq = f"{parts[1]},{parts[0]}{arrow}{out}"
    letters = _equation(eq, val(x).dim())
    if letters is None:
        return None
    xs, ws, os_ = letters
    if len(ws) != val(w).dim():
        return None
    contracted = set(xs) & set(ws)
    features = set(ws) - set(xs)
    batch = set(xs) - set(ws)
    if not contracted or not features or contracted & set(os_) or set(os_) != batch | features:
        return None
    out_first = _runs(ws, contracted)
    if out_first is None:
        return None
    xshape, wshape = val(x).shape, val(w).shape
    for c in contracted:  # no broadcasting of a size-1 dim: the sizes match as ints
        a, b = xshape[xs.index(c)], wshape[ws.index(c)]
        if not isinstance(a, int) or not isinstance(b, int) or a != b:
            return None
    if not all(isinstance(s, int) for s in wshape):
        return None
    return x, w, xs, ws, os_, out_first


def _rewrite(graph: fx.Graph, node: fx.Node, x, w, xs, ws, os_, out_first) -> None:
    call = caller(graph, node, [val(x), val(w)])
    meta = {k: v for k, v in node.meta.items() if k != "val"}
    contracted = [c for c in ws if c in xs]
    features = [c for c in ws if c not in xs]
    batch = [c for c in os_ if c not in ws]
    xshape, wshape = val(x).shape, val(w).shape
    with graph.inserting_before(node):
        sizes = {}
        for i, c in enumerate(xs):
            if c in batch:
                s = xshape[i]
                if isinstance(s, torch.SymInt):
                    sizes[c] = graph.call_function(aten.sym_size.int, (x, i))
                    sizes[c].meta = {**meta, "val": s}
                else:
                    sizes[c] = int(s)
        order = [xs.index(c) for c in batch + contracted]
        xin = x if order == list(range(len(xs))) else call(aten.permute.default, x, order)
        if len(contracted) > 1:
            k = math.prod(int(xshape[xs.index(c)]) for c in contracted)
            xin = call(aten.reshape.default, xin, [sizes[c] for c in batch] + [k])
        n_out = math.prod(int(wshape[ws.index(c)]) for c in features)
        n_in = math.prod(int(wshape[ws.index(c)]) for c in contracted)
        wl = w
        if out_first:
            if len(ws) > 2:
                wl = call(aten.reshape.default, w, [n_out, n_in])
        else:
            if len(ws) > 2:
                wl = call(aten.reshape.default, w, [n_in, n_out])
            wl = call(aten.t.default, wl)
        y = call(aten.linear.default, xin, wl)
        if len(features) > 1:
            y = call(aten.view.default, y, [sizes[c] for c in batch] +
                     [int(wshape[ws.index(c)]) for c in features])
        have = batch + features
        if have != list(os_):
            y = call(aten.permute.default, y, [have.index(c) for c in os_])
    node.replace_all_uses_with(y)
    graph.erase_node(node)


# a 2-D weight's transpose: W.t(), W.T, W.transpose(0, 1) / (-1, -2), W.permute(1, 0)
def _transposed_param(wt, params: set):
    """The parameter (read directly or through casts) whose 2-D transpose ``wt`` is, else
    None."""
    if not isinstance(wt, fx.Node) or wt.op != "call_function" or not wt.args:
        return None
    w = wt.args[0]
    if not isinstance(w, fx.Node) or not isinstance(val(w), torch.Tensor) or val(w).dim() != 2:
        return None
    if wt.target is aten.t.default or wt.target is aten.numpy_T.default:
        pass
    elif wt.target is aten.transpose.int and len(wt.args) == 3:
        if sorted(d % 2 for d in wt.args[1:]) != [0, 1]:
            return None
    elif wt.target is aten.permute.default and len(wt.args) == 2:
        if [d % 2 for d in wt.args[1]] != [1, 0]:
            return None
    else:
        return None
    return w if is_param(w, params) else None


def matmuls_as_linears(gm: fx.GraphModule) -> int:
    """Rewrite ``matmul(x, W.t())`` with W a 2-D parameter and x of rank 2 or more (a tied LM
    head written ``hidden @ embedder.weight.t()``, gemma_pytorch) into the ``linear(x, W)``
    it computes, so the planners see an ``nn.Linear``-style head (vocab_parallel then shards
    a tied table with its head). The transpose stays while something else reads it. The
    weight first, ``matmul(W, y)`` with y of rank 3 or more (features on dim -2: Mamba's
    ``dt_proj.weight @ time_step.transpose(1, 2)``), is ``linear(y.mT, W).mT``. Returns how
    many. A 3-D parameter first, ``bmm(W, y)`` of W (E, out, in) and y (E, in, rows) (an
    einsum ``"edf,end->enf"`` lowers to that), is ``bmm(y.mT, W.mT).mT``: E linears side by
    side, as ``analysis/linears.py`` reads them."""
    params = {name for name, _ in gm.named_parameters()}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.matmul.default, aten.bmm.default) \
                or len(node.args) != 2 or node.kwargs:
            continue
        if _weight_first(gm.graph, node, params) or _experts_first(gm.graph, node, params):
            done += 1
            continue
        if node.target is aten.bmm.default:
            continue
        x, wt = node.args
        w = _transposed_param(wt, params)
        if w is None or not isinstance(val(x), torch.Tensor) or val(x).dim() < 2 \
                or val(x).dtype != val(w).dtype or not val(x).is_floating_point():
            continue
        node.target = aten.linear.default
        node.args = (x, w)
        if not wt.users:
            gm.graph.erase_node(wt)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def zero_baddbmm_as_bmm(gm: fx.GraphModule) -> int:
    """Rewrite ``baddbmm(zeros(..), q, k, beta, alpha)`` (or any input with ``beta=0``) into
    the ``alpha * bmm(q, k)`` it computes: attention scores started from a zeros tensor of
    the merged (batch x heads) shape (GPT-NeoX-Japanese). The zeros, sized by the global
    heads, have no sharded rule beside head-sharded q and k, which kept the attention
    replicated; ``bmm`` has one. Returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.baddbmm.default \
                or len(node.args) != 3:
            continue
        base, q, k = node.args
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if set(node.kwargs) - {"beta", "alpha"} or not (beta == 0 or isinstance(base, fx.Node)
                                                        and base.target in ZEROS):
            continue
        with gm.graph.inserting_before(node):
            call = caller(gm.graph, node, [val(q), val(k)])
            out = call(aten.bmm.default, q, k)
            if alpha != 1:
                out = call(aten.mul.Tensor, out, alpha)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        if isinstance(base, fx.Node) and not base.users:
            gm.graph.erase_node(base)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _weight_first(graph: fx.Graph, node: fx.Node, params: set) -> bool:
    """Rewrite ``matmul(W, y)`` (W a 2-D parameter read directly or through casts, y of
    rank 3 or more and W's dtype) into ``linear(y.transpose(-1, -2), W).transpose(-1, -2)``;
    False (left as it is) otherwise."""
    w, y = node.args
    vw, vy = val(w), val(y)
    if node.target is not aten.matmul.default or not isinstance(vw, torch.Tensor) \
            or not isinstance(vy, torch.Tensor) or vw.dim() != 2 \
            or vy.dim() < 3 or not is_param(w, params) or vy.dtype != vw.dtype \
            or not vy.is_floating_point():
        return False
    call = caller(graph, node, [vw, vy])
    with graph.inserting_before(node):
        out = call(aten.linear.default, call(aten.transpose.int, y, -1, -2), w)
        out = call(aten.transpose.int, out, -1, -2)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


def _experts_first(graph: fx.Graph, node: fx.Node, params: set) -> bool:
    """Rewrite ``bmm(W, y)`` / ``matmul(W, y)`` (W a 3-D parameter (E, out, in) read through
    casts, or the transpose of one stored (E, in, out); y (E, in, rows) of W's dtype) into
    ``bmm(y.mT, W.mT).mT``; False (left as it is) otherwise."""
    w, y = node.args
    vw, vy = val(w), val(y)
    if not isinstance(vw, torch.Tensor) or not isinstance(vy, torch.Tensor) or vw.dim() != 3 \
            or vy.dim() != 3 or vy.dtype != vw.dtype or not vy.is_floating_point() \
            or not all(isinstance(d, int) for d in (*vy.shape[:2], *vw.shape)) \
            or (vy.shape[0], vy.shape[1]) != (vw.shape[0], vw.shape[2]):
        return False
    direct = is_param(w, params)
    stored = None if direct or not swaps_last_two(w) else w.args[0]
    if not direct and (stored is None or not is_param(stored, params)):
        return False
    call = caller(graph, node, [vw, vy])
    with graph.inserting_before(node):
        wt = stored if stored is not None else call(aten.transpose.int, w, 1, 2)
        out = call(aten.transpose.int, call(node.target, call(aten.transpose.int, y, 1, 2), wt), 1, 2)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if stored is not None and not w.users:
        graph.erase_node(w)
    return True
