"""norms_over_projections pass: at mesh.tp > 1, a LayerNorm or RMSNorm over a linear's whole
output (not the residual stream), or over an attention's values merged back from the heads
(Magneto's sub-LN before out_proj), is written as the means it computes.

Such a norm sits inside a Megatron pair: NormFormer's FFN norm (``fc2(LayerNorm(gelu(fc1
(x))))``), a query norm over the whole projection written with ``nn.RMSNorm`` (OLMo-2's, which
transformers spells out). As one op it ended the seed walk as a block's input norm does (the
pair's two linears stayed whole, or the whole model was refused), and where a pair reached it
DTensor's strategy all-gathered the features. Written out, its means over the sharded
features are Partial and all-reduced right after ([B, T, 1] each, analysis/sharding/
redistribute.py), its weight and bias sharded with the features, as transformers' own
OLMo-2 q_norm already was. The values differ from the fused kernel's by rounding only;
at mesh.tp = 1 nothing is rewritten (the program stays bit-exact where it was).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..analysis.graph_facts import aten, descendants
from ..analysis.linears import as_linear
from ..analysis.logits import produces_logits
from ..frontend.graph_rewrite import caller, val

_NORMS = {aten.layer_norm.default, aten.rms_norm.default}
# a linear's output reaches the norm through these alone (activations, dropout, casts)
_ONE_INPUT = {aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default,
              aten.sigmoid.default, aten.dropout.default, aten.clone.default,
              aten._to_copy.default, aten.to.dtype, aten.contiguous.default,
              aten.type_as.default}  # type_as(x, other): x cast to other's dtype
# the heads of an attention merged back (``attn.transpose(1, 2).reshape(B, T, E)``): moves
# the values, every one of them, from the projection that made them
_MOVES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.transpose.int, aten.permute.default}
# products whose output's last dim is their last operand's (the values of attention: the
# probabilities times v); the walk follows that operand
_VALUES = {aten.bmm.default: 1, aten.matmul.default: 1,
           aten.scaled_dot_product_attention.default: 2}


def apply_norms_over_projections(gm: fx.GraphModule) -> int:
    """Rewrite each such norm of ``gm`` in place; how many. A norm feeding an LM head is
    left whole (BERT's MLM transform ``dense -> gelu -> LayerNorm -> decoder``): the head is
    vocab_parallel, over the vocabulary, on a replicated input."""
    tables = _tables(gm.graph)
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _NORMS and _over_projection(node) \
                and not _feeds_head(node, tables) and not _starts_stream(node):
            _write_out(gm.graph, node)
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _over_projection(norm: fx.Node) -> bool:
    """``norm`` normalises the last dim only, as many features as a linear outputs, reached
    from the linear through one-input activations, dropout and casts, or through an
    attention's values merged back over the heads (Magneto's sub-LN, torchscale's
    ``inner_attn_ln``: ``LayerNorm(attn.transpose(1, 2).reshape(B, T, E))`` before out_proj;
    the features are v's)."""
    x, shape = norm.args[0], norm.args[1]
    if not isinstance(x, fx.Node) or not isinstance(val(x), torch.Tensor) or len(shape) != 1:
        return False
    moved = False
    for _ in range(16):
        site = as_linear(x)
        if site is not None:
            out = val(x)
            return isinstance(out, torch.Tensor) and out.shape[-1] == shape[0]
        if x.op != "call_function":
            return False
        if x.target in _VALUES and not moved:
            return False  # a product straight into the norm: no heads merged back
        moved = moved or x.target in _MOVES
        arg = x.args[_VALUES.get(x.target, 0)] if x.target in _ONE_INPUT | _MOVES \
            or x.target in _VALUES else None
        if not isinstance(arg, fx.Node):
            return False
        x = arg
    return False


def _starts_stream(norm: fx.Node) -> bool:
    """``norm``'s output, through one-input ops and views, is added to a value computed from
    it (``y + f(y)``): the residual stream the next blocks read, not a value inside a pair.
    torchvision's Swin-V2 ends its PatchMergingV2 with ``norm(reduction(x))``; written out,
    the walk paired the reduction as a column with the next stage's qkv, and the stream
    itself was sharded: a Partial gradient reached a norm of the next block (zoo 17 Z7)."""
    adds, todo = [], [norm]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op != "call_function":
                continue
            if u.target in (aten.add.Tensor, aten.add_.Tensor):
                adds.append((u, n))
            elif u.target in _ONE_INPUT | _MOVES:
                todo.append(u)
    if not adds:
        return False
    below = descendants(norm, limit=4001) - {norm}  # 4000 nodes past the norm
    return any(isinstance(a, fx.Node) and a is not operand and a in below
               for add, operand in adds for a in add.args[:2])


def _tables(graph: fx.Graph) -> tuple[set, set]:
    """(get_attr targets, shapes) of the 2-D tables ``aten.embedding`` reads."""
    targets, shapes = set(), set()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is aten.embedding.default \
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr":
            targets.add(n.args[0].target)
            shapes.add(tuple(val(n.args[0]).shape))
    return targets, shapes


def _feeds_head(norm: fx.Node, tables: tuple[set, set]) -> bool:
    """A linear ``norm``'s output reaches (through one-input ops) is an LM head: it reads an
    embedding table or a weight of a table's shape, or it has a table's rows as its output
    features and produces the logits (RemBERT's decoder, untied and narrower than its input
    table)."""
    targets, shapes = tables
    rows = {s[0] for s in shapes}
    todo, seen = list(norm.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        site = as_linear(n)
        if site is not None:
            w, out = site.param, val(n)
            if w.target in targets or tuple(val(w).shape) in shapes or (
                    out.shape[-1] in rows and produces_logits(n)):
                return True
        elif n.target in _ONE_INPUT:
            todo += list(n.users)
    return False


def _write_out(graph: fx.Graph, norm: fx.Node) -> None:
    x = norm.args[0]
    layer = norm.target is aten.layer_norm.default
    weight = norm.args[2] if len(norm.args) > 2 else None
    bias = norm.args[3] if layer and len(norm.args) > 3 else None
    eps = norm.args[4 if layer else 3] if len(norm.args) > (4 if layer else 3) else None
    eps = (1e-5 if layer else torch.finfo(val(x).dtype).eps) if eps is None else eps
    with graph.inserting_before(norm):
        call = caller(graph, norm, [val(x)])
        centred = call(aten.sub.Tensor, x, call(aten.mean.dim, x, [-1], True)) if layer else x
        var = call(aten.mean.dim, call(aten.mul.Tensor, centred, centred), [-1], True)
        out = call(aten.mul.Tensor, centred, call(aten.rsqrt.default,
                                                  call(aten.add.Tensor, var, eps)))
        if isinstance(weight, fx.Node):
            out = call(aten.mul.Tensor, out, weight)
        if isinstance(bias, fx.Node):
            out = call(aten.add.Tensor, out, bias)
    norm.replace_all_uses_with(out)
    graph.erase_node(norm)
