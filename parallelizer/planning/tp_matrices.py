"""The tensor-parallel planner's report: the count line and summary of sharded weight
matrices, every matrix left whole with its reason, custom ops' weights (read by report.md and
the CLI's summary). Reads the graph and the decision, changes neither."""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from ..plan.decisions import TPDecision
from ..plan.layouts import ReplicatedHeads
from ..analysis.experts import find_expert_layers
from ..analysis.graph_facts import aten, source_line
from ..analysis.linears import VIEWS
from ..analysis.sharding.placements import Shard


def linear_counts(decision: TPDecision, vocab_heads=()) -> str:
    """report.md's count of the linears by role, naming every one kept replicated (the LM
    heads vocab_parallel shards over the vocabulary are not: ``vocab_heads``), then the other
    weight matrices kept replicated (read by an op that is no linear: :func:`other_matrices`)."""
    heads = sorted(w for w in decision.linears if w in set(vocab_heads))
    kept = [w for w in decision.linears
            if w not in decision.column and w not in decision.row and w not in heads]
    other = list(decision.other_replicated)
    parts = [f"column_parallel: {len(decision.column)} linears",
             f"row_parallel: {len(decision.row)} linears"]
    if heads:
        parts.append(f"vocab_parallel LM head: {', '.join(heads)}")
    if kept:
        parts.append(f"replicated: {len(kept)} linears ({', '.join(kept)})")
    if other:
        parts.append(f"replicated{' too' if kept else ''}: {len(other)} other weight matrices "
                     f"({', '.join(other)})")
    if not kept and not other:
        parts.append("replicated: none")
    return "; ".join(parts)


# ops a weight is read through on its way to the op that uses it (the reason names that op)
_WEIGHT_PATH = frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.type_as.default, aten.contiguous.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten._assert_tensor_metadata.default})


def other_matrices(graph: fx.Graph, decision: TPDecision, expert_dims=()) -> dict:
    """fqn -> report line of every parameter of two or more dims that ``graph`` reads, that
    tensor parallelism leaves whole on every rank and that no other line accounts for: not a
    linear's weight (those are counted and named by role), not read by ``aten.embedding`` (the
    vocabulary planner reports tables), by an operator outside ATen (:func:`custom_op_weights`)
    or as stacked experts, nor split by the experts planner (``expert_dims``: an expert
    layer's bias). The line names the op that reads it and its
    source line: an einsum that is no linear map (capture makes those linears: a per-head
    block-diagonal ``einsum("bshd,hde->bshe", x, w)``),
    a convolution, a mixing matrix of the heads. Per-head tensors cut to each rank's heads
    while the step runs (a redistribution) say so."""
    owner = graph.owning_module
    params = dict(owner.named_parameters()) if owner is not None else None
    linears = set(decision.linears)
    experts = {w for layer in find_expert_layers(graph)[0] for w in layer.weights} | set(expert_dims)
    cut = {r.producer for r in decision.redistributions}
    out: dict = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op != "get_attr" or not isinstance(v, torch.Tensor) \
                or not is_matrix(v) and not _as_matrix(n) \
                or n.target in decision.dims or n.target in linears or n.target in experts \
                or n.target in out:
            continue
        if params is not None and n.target not in params:
            continue  # a buffer (rotary tables, masks): no weight
        readers = _readers(n)
        if not readers or any(u.target is aten.embedding.default for u, _ in readers) or any(
                getattr(u.target, "namespace", "aten") not in ("aten", "prims") for u, _ in readers):
            continue
        use, via = readers[0]
        shape_text = "x".join(str(d) for d in v.shape) + (", flat" if v.dim() == 1 else "")
        producer = next((c for c in cut if c == n.name or c in via), None)
        if producer is not None:
            why = (f"each rank cuts its heads, or its copy of them, from it as the step runs: "
                   f"the redistribution of {producer}")
        elif isinstance(decision.placements.get(use.name), Shard):
            why = ("each rank applies it whole to its shard of the op's input: a weight "
                   "every head or sample shares (Primer's depthwise conv per head), its "
                   "gradient summed over tp")
        else:
            why = ("no tensor-parallel rule splits a weight this op reads: only linear layers "
                   "(a product with a 2-D weight, a pointwise conv), per-head tensors and the "
                   "per-channel tensors of a grouped conv or a norm over sharded channels are "
                   "sharded" + ("; a flat weight viewed as the matrix is not: store it 2-D"
                                if v.dim() == 1 else ""))
        out[n.target] = (f"replicated: {n.target} ({shape_text}, read by {op_text(use)}: "
                         f"{why})")
    return out


_PRODUCTS = frozenset({aten.linear.default, aten.mm.default, aten.bmm.default,
                       aten.matmul.default, aten.addmm.default, aten.baddbmm.default,
                       aten.einsum.default, aten.convolution.default})


def _as_matrix(param: fx.Node) -> bool:
    """A 1-D parameter viewed as a matrix on its way to a product reading it (a flat weight,
    ``F.linear(x, w.view(o, i))``): a weight matrix as the op sees it, reported like one (a
    bias viewed ``(1, 1, n)`` for an add is none)."""
    frontier = [param]
    while frontier:
        for u in frontier.pop().users:
            if u.op == "call_function" and u.target in _WEIGHT_PATH:
                v = u.meta.get("val")
                if u.target in VIEWS and isinstance(v, torch.Tensor) and v.dim() >= 2 \
                        and any(r.target in _PRODUCTS for r, _ in _readers(u)):
                    return True
                frontier.append(u)
    return False


def _readers(param: fx.Node) -> list:
    """(op, names of the weight-path nodes on the way) of each op reading ``param``, through
    casts, views and transposes (:data:`_WEIGHT_PATH`), in graph order."""
    found, frontier = [], [(param, frozenset())]
    while frontier:
        node, via = frontier.pop(0)
        for u in node.users:
            if u.op == "call_function" and u.target in _WEIGHT_PATH:
                if u.target is not aten._assert_tensor_metadata.default:
                    frontier.append((u, via | {u.name}))
            elif u.op != "output":
                found.append((u, via))
    return found


def custom_op_weights(graph: fx.Graph) -> list[str]:
    """Report lines for parameters read by operators outside ATen: no sharding rule covers
    them, so they stay replicated on every tp rank. The stacked weights of an expert layer
    (Mixtral's through ``transformers::grouped_mm_fallback``) are left to the experts
    planner, which splits them over tp or says why not (planning/experts.py)."""
    experts = {w for layer in find_expert_layers(graph)[0] for w in layer.weights}
    found: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "aten") not in (
                "aten", "prims"):
            for a in node.all_input_nodes:
                src = a
                while src.op == "call_function" and src.target in (
                        aten.transpose.int, aten.t.default, aten.permute.default,
                        aten._to_copy.default, aten.view.default, aten.reshape.default):
                    src = src.args[0]
                if src.op == "get_attr" and src.target not in experts:
                    found.setdefault(str(node.target).rsplit(".", 1)[0], []).append(src.target)
    return [f"kept replicated: {', '.join(sorted(set(ws)))} (read by {op}, an operator with no "
            f"tensor-parallel sharding rule)" for op, ws in found.items()]


def op_text(node: fx.Node) -> str:
    where = source_line(node)
    return f"{node.target} at {where}" if where else str(node.target)


def is_matrix(t) -> bool:
    """A weight matrix (any 2-D tensor: a linear's weight, a projection to one feature
    included), a kernel or a table (more dims, two of them of more than one element). A
    per-channel gain stored ``(1, C, 1, 1)`` (a channel LayerNorm's), a LayerScale ``(1, 1,
    D)`` or a per-head ``(H, 1, 1)`` is a vector however many dims it keeps."""
    return t.dim() == 2 or t.dim() > 2 and sum(int(s) > 1 for s in t.shape) >= 2


def block_matrices(model, blocks=()) -> dict:
    """fqn -> numel of the weight matrices (:func:`is_matrix`: a linear's or an einsum's
    weight, a per-head 3-D projection, a convolution's kernel) in the model's blocks:
    the items of every ``nn.ModuleList`` (T5's encoder and decoder blocks) and ``blocks``
    (module FQNs, planning/blocks.py find_blocks: an ``nn.Sequential``'s or ``ModuleDict``'s
    items too)."""
    prefixes = _block_prefixes(model, blocks)
    return {n: p.numel() for n, p in model.named_parameters()
            if is_matrix(p) and n.startswith(prefixes)}


def _block_prefixes(model, blocks=()) -> tuple:
    import torch.nn as nn
    return tuple(f"{b}." for b in blocks) + tuple(
        f"{name}.{i}." for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) for i in range(len(m)))


def tp_summary(decision: TPDecision, model, vocab=None, blocks=(), experts=None,
               stacked=None, read=None) -> str:
    """``tensor parallel: N of M weight matrices in blocks sharded (P % of parameters)``:
    P counts the elements of every parameter (embeddings and norms too) that tp shards, the
    vocabulary tables of ``vocab`` (a VocabDecision) and the experts split along their FFN
    dim (``experts``: fqn -> tp dim, the EPDecision's ``dims``; ``stacked``: a stacked FQN ->
    the per-module experts it stands for, passes/stack_experts.py) too; the blocks are
    ``blocks`` where given (see :func:`block_matrices`). A model with no blocks (no
    ``nn.ModuleList``, none found by planning/blocks.py) says so and counts the weight
    matrices of the whole model instead; the matrices outside the blocks that an op computes
    with (a classifier, a conv stem, a recurrent cell's, a position table added; not a table
    an embedding looks up, nor one vocab_parallel's line reports) are counted after (``; K of
    L outside them``). One kv head copied to every rank (multi-query, ``replicated_heads`` of
    1 head) is held whole by each rank and not counted sharded. P is
    rounded, but never to 100 while a parameter is left whole (nor to 0
    while one is sharded). The all-gathers of sharded activations the plan inserts are
    counted after it: a matrix counted sharded may feed an op that then runs whole on every
    rank (q, k, v of heads laid out inner, gathered before attention). With ``read`` (the
    names the graph reads), parameters no node reads (a block forward never calls) are
    counted in neither N, M nor P, and the line says how many such matrices it left out."""
    unread = _unread(model, read, stacked)
    mats, where = _counted_matrices(model, blocks, unread)
    dims = _under_every_name(_sharded(decision, vocab, experts, stacked), model)
    sharded = [n for n in mats if n in dims]
    params = {n: p for n, p in model.named_parameters() if n not in unread}
    total = sum(p.numel() for p in params.values()) or 1
    split = sum(p.numel() for n, p in params.items() if n in dims)
    pct = f"{100 * split / total:.0f}"
    if (pct == "100" and split < total) or (pct == "0" and split > 0):
        pct = f"{min(max(100 * split / total, 0.1), 99.9):.1f}"
    head = "tensor parallel: " if where == "in blocks" else \
        "tensor parallel: no repeated blocks found; "
    # a WaveRNN read "4 of 4 weight matrices in blocks sharded (6 % of parameters)", the ten
    # it keeps whole outside its blocks unsaid (a break test)
    outside = _outside(decision, model, mats, vocab, experts) if where == "in blocks" else []
    also = (f"; {sum(n in dims for n in outside)} of {len(outside)} outside them"
            if outside else "")
    gathered = sum(r.kind == "all_gather" for r in decision.redistributions)
    whole = (f"; {gathered} sharded activation(s) all-gathered where no sharded rule takes "
             f"them, the ops after computed whole (report.md)" if gathered else "")
    idle = sum(is_matrix(p) for n, p in model.named_parameters() if n in unread)
    idle = f"; {idle} weight matrices forward never reads not counted" if idle else ""
    return (f"{head}{len(sharded)} of {len(mats)} weight matrices {where} sharded{also} "
            f"({pct} % of parameters){whole}{idle}")


def _unread(model, read, stacked=None) -> set:
    """Names of the parameters none of ``read`` (the graph's get_attr targets; None: all
    read) reads: a parameter read under one of its names is read under all, and the experts
    of a stacked tensor read are read."""
    if read is None:
        return set()
    read = set(read) | {m for f, ms in (stacked or {}).items() if f in read for m in ms}
    return {n for group in _name_groups(model) if read.isdisjoint(group) for n in group}


def _name_groups(model) -> list:
    """The names of each parameter, one list per tensor (a tied weight has two)."""
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return list(names.values())


def _outside(decision: TPDecision, model, mats: dict, vocab=None, experts=None) -> list:
    """The weight matrices outside ``mats`` (the blocks') an op computes with: a linear's, an
    einsum's or a conv's weight, sharded or not (the TP planner's ``linears``,
    ``other_replicated`` and ``dims``), by their first name; a vocabulary table or LM head
    (``vocab``'s line reports them) and a table an embedding only looks up are not."""
    computed = set(decision.linears) | set(decision.other_replicated) | set(decision.dims) \
        | set(experts or ())
    counted = set(mats) | ((set(vocab.dims) | vocab.tables | vocab.heads) if vocab is not None
                           else set())
    return sorted(group[0] for group in _name_groups(model)
                  if not counted.intersection(group) and computed.intersection(group)
                  and is_matrix(model.get_parameter(group[0])))


def _under_every_name(dims: dict, model) -> dict:
    """``dims`` with each parameter under all its names: a weight shared by two blocks is
    planned under the name the graph reads it by, and counted under its first (it read "0
    of 4 sharded", 0 %, for two blocks sharing sharded expert weights: a break test)."""
    out = dict(dims)
    for group in _name_groups(model):
        d = next((dims[n] for n in group if n in dims), None)
        if d is not None:
            out.update(dict.fromkeys(group, d))
    return out


def _counted_matrices(model, blocks=(), unread=frozenset()) -> tuple[dict, str]:
    """(fqn -> numel, "in blocks" | "in the model"): the weight matrices the count line
    counts, the whole model's when it has no blocks, none of ``unread``."""
    if _block_prefixes(model, blocks):
        mats, where = block_matrices(model, blocks), "in blocks"
    else:
        mats = {n: p.numel() for n, p in model.named_parameters() if is_matrix(p)}
        where = "in the model"
    return {n: k for n, k in mats.items() if n not in unread}, where


def _sharded(decision: TPDecision, vocab=None, experts=None, stacked=None) -> dict:
    """fqn -> tp dim of every parameter tp shards (see :func:`tp_summary`)."""
    dims = {**decision.dims, **(vocab.dims if vocab is not None else {}), **(experts or {})}
    for fqn, members in (stacked or {}).items():
        if fqn in dims:
            dims.update(dict.fromkeys(members, dims[fqn]))
    for fqn, layout in decision.layouts.items():  # one kv head copied: every rank holds it
        if isinstance(layout, ReplicatedHeads) and layout.heads == 1:
            dims.pop(fqn, None)
    return dims


def tp_kept_note(decision: TPDecision, model, vocab=None, blocks=(), experts=None,
                 stacked=None, read=None) -> str:
    """After :func:`tp_summary`'s line, where it counts matrices not sharded: the first of
    them (in the model's order, the blocks' before those outside them) with the report.md
    line that says why, so a replicated attention is explained where the count is read; ""
    when all are sharded or no line names it."""
    mats, where = _counted_matrices(model, blocks, _unread(model, read, stacked))
    dims = _sharded(decision, vocab, experts, stacked)
    outside = _outside(decision, model, mats, vocab, experts) if where == "in blocks" else []
    left = [n for n in [*mats, *outside] if n not in dims]
    for fqn in left:
        name = re.compile(rf"(?<![\w.]){re.escape(fqn)}(?![\w.])")
        line = next((r for r in decision.report if name.search(r)), None)
        if line is not None:
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            return f"tensor parallel: not sharded {fqn}{more}; {line} (report.md gives each)"
    return ""