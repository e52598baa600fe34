"""Ops of a captured forward that mix the samples of a batch: a reduction over dim 0 of a
value whose dim 0 is the batch (``h - h.mean(0)``), batch normalisation in training mode.
Their output for one sample depends on the others, so a program that cuts the batch into
data-parallel shards or pipeline microbatches computes another loss than the whole batch
gives (the compile's warning names them: emit/reference.py ``sample_mean_warnings``)."""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_facts import aten, same, source_line

_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.var.correction, aten.std.correction,
               aten.var_mean.correction, aten.std_mean.correction, aten.amax.default,
               aten.amin.default, aten.logsumexp.default, aten.max.dim, aten.min.dim,
               aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim}
_BATCH_NORMS = {aten.batch_norm.default, aten.native_batch_norm.default,
                aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
                aten._native_batch_norm_legit_functional.default}


def batch_mixing(graph: fx.Graph) -> list[str]:
    """``op at file.py:line`` for each op of ``graph`` that mixes the batch's samples (module
    docstring), in graph order, one per line; the batch is dim 0 of the first input."""
    batch = next((n.meta["val"].shape[0] for n in graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()), None)
    if batch is None:
        return []
    out = {}
    for n in graph.nodes:
        if n.op != "call_function" or not _mixes(n, batch):
            continue
        where = source_line(n)
        text = f"{n.target} ({n.name})" + (f" at {where}" if where else "")
        out.setdefault(where or n.name, text)
    return list(out.values())


def _mixes(n: fx.Node, batch) -> bool:
    x = n.args[0] if n.args else None
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or not v.dim() or not same(v.shape[0], batch):
        return False
    if n.target in _BATCH_NORMS:  # training: the statistics of this batch
        return bool(n.args[3] if n.target is aten._native_batch_norm_legit.no_stats
                    else n.args[5])
    if n.target in _REDUCTIONS:
        dims = _dims(n)
        dims = [dims] if isinstance(dims, int) else list(dims or ())
        return any(d % v.dim() == 0 for d in dims)
    return False


def _dims(n: fx.Node):
    """The reduction's ``dim`` argument, found by name in the op's schema: a vector norm's
    second argument is its order (``linalg_vector_norm(x, 2.0, [-1])``: F.normalize), which
    was read as the dims ("'float' object is not iterable", zoo 25 F10)."""
    names = [a.name for a in n.target._schema.arguments]
    i = names.index("dim")
    return n.kwargs["dim"] if "dim" in n.kwargs else n.args[i] if len(n.args) > i else None
