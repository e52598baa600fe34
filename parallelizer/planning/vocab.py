"""Vocab-parallel planner: shard the vocabulary embedding and the LM head over tp.

Shoeybi et al. 2019 (Megatron-LM), §3 "input embedding ... parallelized along the vocabulary
dimension (column-wise)", the output embedding likewise, tied weights sharded the same way.

Reads the graph and the TP decision, changes neither; returns its own
:class:`~parallelizer.plan.decisions.VocabDecision` (passes/vocab_parallel.py applies it):

- the vocabulary tables are the ``aten.embedding`` weights an LM head reads (tied) or has the
  shape of, else (no head: an encoder) those with the most rows among the tables the model's
  inputs index (token ids, not ``arange`` positions or distances); position and token-type
  tables stay replicated. Each is ``Shard(0)`` with layout ``padded``: padded to a multiple
  of tp when tp does not divide it (padded_size = the vocabulary when it does, so a reshard
  to another tp pads it);
- a head is an ``nn.Linear`` (``aten.linear``; a bias is sharded with it) whose weight is a
  vocabulary table (tied) or, untied, has its shape and produces the logits (its output
  reaches the model's outputs with no other product, attention or split into heads between,
  :func:`produces_logits`): it becomes column_parallel over the vocabulary, its logits
  ``Shard(-1)``; a head applied several times (multi-token prediction's one head for every
  depth) is sharded once, each use a head. Logits the model returns are handed to
  ``loss_fn`` sharded (flat output index in ``vocab_outputs``); any other use reads them
  gathered over tp.

A table read by anything else (a norm, ``embedding_renorm_``; a matmul of its transpose is a
linear since capture, ``frontend/einsum.py`` ``matmuls_as_linears``) or an
embedding with ``scale_grad_by_freq``/``sparse`` blocks vocab_parallel: off under ``auto``
(report.md says why), a PlanError under ``true``.
"""
from __future__ import annotations

import torch.fx as fx

from ..plan.decisions import TPDecision, VocabDecision
from ..plan.layouts import Padded
from .tp_matrices import linear_counts
from ..errors import PlanError
from ..analysis.graph_facts import aten, shape, source_line, weight_fqn
from ..analysis.logits import logits_region, produces_logits

KEY = "tensor_parallel.vocab_parallel"


def plan_vocab(graph: fx.Graph, tp: int, mode, canonical: dict, tp_decision: TPDecision
               ) -> VocabDecision:
    """Which tables and LM heads to shard over the vocabulary. ``mode``: the spec's ``auto`` |
    True | False; ``canonical``: every name of a tied group -> its first name; ``tp_decision``:
    the linears tensor parallelism already shards (never a head).

    Raises:
        PlanError: ``mode`` is True and vocab_parallel cannot apply; names the spec key, the
            blocking op (file:line) and the fix.
    """
    decision = VocabDecision()
    if tp == 1 or mode is False:
        if tp > 1:
            decision.off = (f"vocab_parallel: off ({KEY}=false); embedding and LM head "
                            f"replicated")
            decision.report.append(decision.off)
        return decision
    canon = lambda n: canonical.get(n, n)  # noqa: E731
    reads: dict = {}  # canonical fqn -> get_attr nodes reading it
    for n in graph.nodes:
        if n.op == "get_attr":
            reads.setdefault(canon(n.target), []).append(n)
    # a table tensor parallelism shards along its heads (a relative-position bias, one column
    # per head: CPM-Ant's, larger than its vocabulary) is no vocabulary, whatever its rows
    per_head = {canon(f) for f in tp_decision.per_head}
    lookups = [n for n in graph.nodes if n.op == "call_function"
               and n.target is aten.embedding.default and _table(n)
               and canon(n.args[0].target) not in per_head]
    if not lookups:
        return _off(decision, mode, "the graph has no aten.embedding of a 2-D parameter")
    rows = {canon(n.args[0].target): tuple(shape(n.args[0])) for n in lookups}
    # an untied head is found by its role (its logits are the model's output or its loss's
    # input), never by its shape alone: a block's linear of the table's shape (Phi-3's fused
    # q|k|v at 64 x 32 with a 64-row vocabulary) is no head
    untied = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.linear.default
              and weight_fqn(n.args[1]) and canon(n.args[1].target) not in rows
              and n.args[1].target not in tp_decision.dims and produces_logits(n)]
    # the vocabulary: the tables an LM head reads (tied) or has the shape of; else the largest
    headed = {f for f in rows if any(u.target is aten.linear.default for a in reads[f]
                                     for u in a.users)}
    headed |= {f for f in rows for n in untied if tuple(shape(n.args[1])) == rows[f]}
    # without a head (an encoder) the vocabulary is a table the model's inputs index: a
    # relative-position table indexed by ``arange`` distances (Wav2Vec2-BERT's
    # distance_embedding, read per head) is no vocabulary, whatever its rows
    pool = headed or {canon(n.args[0].target) for n in lookups if _indexed_by_inputs(n.args[1])}
    if not pool:
        return _off(decision, mode, "no embedding is indexed by the model's inputs (the "
                                    "tables are positions or distances it computes)")
    vocab = max(rows[f][0] for f in pool)
    tables = sorted(f for f in pool if rows[f][0] == vocab)
    for f in sorted(set(rows) - set(tables)):
        decision.report.append(f"replicated embedding: {f} ({rows[f][0]} rows; not the "
                               f"vocabulary table{'s' if len(tables) > 1 else ''} "
                               f"{', '.join(tables)})")
    heads, blockers = [], []
    for f in tables:
        for user in (u for a in reads[f] for u in a.users):
            attr = a_of(user, reads[f])
            why, split = _blocker(user, attr), _tp_sharded(user, attr, tp_decision)
            if why:
                blockers.append(f"{_op_text(user)} reads {f}: {why}")
            elif split:
                return _off(decision, mode, split,
                            "the embedding table split as the tp plan splits its head")
            elif user.target is aten.linear.default:
                heads.append(user)
    if blockers:
        return _off(decision, mode, blockers[0])
    for n in untied:
        if tuple(shape(n.args[1])) in {rows[f] for f in tables}:
            why = _untied_blocker(n, reads[canon(n.args[1].target)], untied)
            if why:
                decision.report.append(f"replicated LM head: {n.args[1].target} ({why})")
            else:
                heads.append(n)
    _decide(graph, decision, tp, vocab, tables, heads, canonical)
    return decision


def a_of(user: fx.Node, attrs: list) -> fx.Node:
    return next(a for a in attrs if a in user.all_input_nodes)


def _table(n: fx.Node) -> bool:
    w = n.args[0]
    return bool(weight_fqn(w)) and w.meta.get("val") is not None and len(shape(w)) == 2


def _blocker(user: fx.Node, attr: fx.Node) -> str:
    """Why ``user`` reading table ``attr`` prevents vocab_parallel ('' if it does not)."""
    if user.op == "call_function" and user.target is aten.embedding.default \
            and user.args[0] is attr and attr not in user.args[1:]:
        extra = list(user.args[3:]) + [user.kwargs.get(k) for k in ("scale_grad_by_freq", "sparse")]
        if any(extra):
            return ("an embedding with scale_grad_by_freq or sparse gradients (their counts "
                    "and sparse rows are per rank)")
        return ""
    if user.op == "call_function" and user.target is aten.linear.default \
            and user.args[1] is attr and user.args[0] is not attr and _bias_ok(user):
        return ""
    return (f"vocab_parallel needs the table read only by aten.embedding and as the weight of "
            f"an nn.Linear head (here: {user.target})")


def _tp_sharded(user: fx.Node, attr: fx.Node, tp_decision: TPDecision) -> str:
    """Why a tied head the tp plan already shards keeps the table out of vocab_parallel (''
    if it does not): a row of a column before it (OPT-350m's ``project_out``, narrowing the
    hidden size to the embedding's) splits the table along its embedding dim, and one tensor
    is split one way. An untied head the tp plan shards is left to it the same way."""
    if user.target is not aten.linear.default or attr.target not in tp_decision.dims:
        return ""
    role = "row_parallel" if attr.target in tp_decision.row else "column_parallel"
    return (f"the tp plan shards the LM head {attr.target} as a {role} linear (split along "
            f"dim {tp_decision.dims[attr.target]}); one tensor is split one way")


def _bias_ok(n: fx.Node) -> bool:
    """No bias, or a 1-D parameter (sharded with the head's rows)."""
    b = n.args[2] if len(n.args) > 2 else None
    return b is None or (bool(weight_fqn(b)) and len(shape(b)) == 1 and len(b.users) == 1)


def _untied_blocker(n: fx.Node, attrs: list, untied: list) -> str:
    """Why the untied head ``n`` stays replicated ('' if it does not). Its weight may be read
    by other heads (``untied``: linears producing logits), each sharded the same way: a
    multi-token-prediction model applies one LM head to every depth's hidden states."""
    if not _bias_ok(n):
        return "its bias is not a parameter read by the head alone"
    others = [u for a in attrs for u in a.users if u is not n and u not in untied]
    return f"its weight is also read by {others[0].target}" if others else ""


def _decide(graph, decision: VocabDecision, tp: int, vocab: int, tables: list, heads: list,
            canonical: dict) -> None:
    padded = -(-vocab // tp) * tp
    # padded even when tp divides the vocabulary (padded_size = vocab): the checkpoint then
    # knows the dim may be padded, so reshard to a tp that does not divide it pads it
    layout = Padded(padded)
    names = set(tables) | {n.args[1].target for n in heads}
    names |= {n.args[2].target for n in heads if len(n.args) > 2 and n.args[2] is not None}
    names |= {a for a, c in canonical.items() if c in names}
    for f in names:
        decision.vocab[f] = vocab
        decision.layouts[f] = layout
    decision.heads = {n.args[1].target for n in heads}
    decision.tables = set(tables)
    out = graph.output_node()
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    region = {n for h in heads for n in logits_region(h)}
    for i, a in enumerate(flat):
        if a in region:
            decision.outputs[i] = vocab
    pad = (f", padded to {padded} rows (zero, never in the loss or the logits returned)"
           if padded != vocab else "")
    decision.report.append(
        f"vocab_parallel: {', '.join(sorted(tables))} Shard(0) over tp, {padded // tp} of "
        f"{vocab} vocabulary rows per rank{pad}; lookups outside a rank's rows give zero, "
        f"summed over tp (Megatron g: an all-reduce, a reduce-scatter along the sequence under "
        f"sequence parallelism)")
    uses = [n.args[1].target for n in heads]
    for w in sorted(set(uses)):
        times = f", applied {uses.count(w)} times" if uses.count(w) > 1 else ""
        decision.report.append(
            f"vocab_parallel LM head: {w} column_parallel over the vocabulary "
            f"(logits Shard(-1){times})")
    for i in sorted(decision.outputs):
        decision.report.append(
            f"vocab_parallel logits: model output {i} is handed to loss_fn as a DTensor "
            f"Shard(-1) under torch loss_parallel (cross-entropy without gathering the logits); "
            f"gathered over tp where returned whole (--verify) or where loss_fn fails on a DTensor")
    losses = _cross_entropies(region, vocab)
    for ce, view in losses:
        decision.losses[ce.name] = vocab
        decision.report.append(
            f"vocab_parallel cross-entropy: {_op_text(ce)} computed on the logits' tp shards "
            f"(max, target logit and sum of exponentials all-reduced; Megatron-LM "
            f"vocab_parallel_cross_entropy), the logits never gathered for it")
    done = {u for ce, view in losses for u in (ce, view)}
    others = [u for n in region for u in n.users
              if u.op != "output" and u not in region and u not in done
              and u.target is not aten._assert_tensor_metadata.default]  # cleanup drops these
    if others:
        decision.report.append(
            f"vocab_parallel logits gathered over tp in the graph for "
            f"{', '.join(sorted({str(u.target) for u in others}))} (the in-graph loss or other "
            f"uses read them whole)")


def _cross_entropies(region, vocab: int) -> list:
    """(cross_entropy_loss node, the view it reads or None) for each unweighted, unsmoothed
    cross-entropy over ``logits.view(-1, vocab)`` (or 2-D logits) of a region node."""
    found = []
    for n in region:
        for u in n.users:
            view = None
            if u.target in (aten.view.default, aten.reshape.default) and u.args[0] is n \
                    and _two_d(u, vocab) and all(_plain_ce(c, u) for c in u.users):
                view, ces = u, list(u.users)
            elif _plain_ce(u, n) and _two_d(n, vocab):
                ces = [u]
            else:
                continue
            found += [(c, view) for c in ces]
    return found


def _two_d(n: fx.Node, vocab: int) -> bool:
    v = n.meta.get("val")
    return v is not None and v.dim() == 2 and v.shape[-1] == vocab


def _plain_ce(c: fx.Node, logits: fx.Node) -> bool:
    if c.op != "call_function" or c.target is not aten.cross_entropy_loss.default or c.kwargs:
        return False
    args = list(c.args) + [None, 1, -100, 0.0][len(c.args) - 2:]
    return args[0] is logits and args[1] is not logits and args[2] is None and args[5] == 0.0


def _indexed_by_inputs(idx) -> bool:
    """``idx`` (an embedding's indices) is computed from a model input's values (token ids,
    clamped or shifted), not only from sizes (``arange(x.shape[1])``) and buffers."""
    todo, seen = [idx], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        if n.op == "call_function" and n.target in _SIZES:
            continue
        todo += n.all_input_nodes
    return False


_SIZES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def _off(decision: VocabDecision, mode, why: str,
         held: str = "embedding and LM head replicated") -> VocabDecision:
    if mode is True:
        raise PlanError(f"{KEY}=true but the vocabulary cannot be sharded over tp: {why}; set "
                        f"{KEY}=auto (or false) to keep the embedding and LM head replicated")
    decision.off = f"vocab_parallel: off ({why}); {held}"
    decision.report.append(decision.off)
    return decision


def _op_text(node: fx.Node) -> str:
    where = source_line(node)
    return f"{node.target} at {where}" if where else str(node.target)


def vocab_summary(decision: VocabDecision) -> str:
    """The compile's one line on vocab_parallel: what is sharded, or why not."""
    if not decision.vocab:
        return decision.off or "vocab_parallel: off (no vocabulary table)"
    tables = sorted(decision.tables - decision.heads)  # a head's bias is no table
    heads = sorted(decision.heads)
    loss = ", cross-entropy on the shards" if decision.losses else ""
    logits = ", logits to loss_fn as DTensor Shard(-1)" if decision.outputs else ""
    # a head that multiplies the table itself (``hidden @ W.t()`` captured as a linear of W)
    # is the table: one name for both
    what = (f"embedding {', '.join(tables)}" + (f" and LM head {', '.join(heads)}" if heads
                                                else "")) if tables else \
        f"embedding and LM head {', '.join(heads)} (one table)"
    return (f"vocab parallel: {what} sharded over the vocabulary "
            f"({next(iter(decision.vocab.values()))} rows){loss}{logits}")


def tp_report(tp: TPDecision, vocab: VocabDecision) -> list[str]:
    """The plan's tensor-parallel report lines: the count of linears by role (every
    replicated one named), the TP planner's lines less its "replicated linear" lines of the
    heads vocab_parallel shards (they are not replicated), then vocab_parallel's. Empty at
    tp = 1 (nothing planned)."""
    if tp.tp == 1:
        return list(vocab.report)
    sharded = {line for w in vocab.heads for line in tp.replicated.get(w, ())}
    return ([linear_counts(tp, vocab.heads)] + [r for r in tp.report if r not in sharded]
            + vocab.report)
