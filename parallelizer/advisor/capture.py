"""The advisor's view of a model file: its per-unit FLOPs, parameters and kernels as a
:class:`~parallelizer.advisor.workload.Workload`, captured once on the meta device."""
from __future__ import annotations

from pathlib import Path

import torch

from ..analyse import analyse, measure
from ..frontend.model_file import load_model
from ..passes.manager import PassManager
from ..analysis.expert_ffn import expert_ffn
from ..analysis.experts import find_expert_layers
from .inventory import GraphInventory, concrete, requires_grad_nodes, tensor_roles
from .workload import MoELayer, Workload

_WORKLOADS: dict = {}


def capture_workload(model_path: Path, seq: int | None):
    """:func:`_capture_workload`, once per (file, modification time, seq) in a process."""
    path = Path(model_path).resolve()
    key = (path, path.stat().st_mtime_ns, seq)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = _capture_workload(path, seq)
    return _WORKLOADS[key]


def _capture_workload(model_path: Path, seq: int | None):
    """Capture ``model_path`` on the meta device at 2 x ``seq`` tokens (default the
    example's; 2 rather than 1 so that export keeps the batch dim dynamic) with the
    compiler's front end (:func:`parallelizer.analyse.analyse` and ``measure``: the same
    capture, attention rewrite and costs), and turn its per-unit costs, halved to one
    sequence, into a Workload whose kernels (``advisor/inventory.py``) the step-time model
    evaluates at any micro-batch size."""
    loaded = load_model(model_path, on_meta=True)
    model = loaded.model
    batch = _meta_batch(loaded.batch, seq)
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    seq = first.shape[1]
    passes = PassManager()
    analysis = analyse(model, batch, Path(model_path), passes)
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    symbols = _symbols(analysis.gm)
    roles, sites, notes, divides = tensor_roles(analysis.gm.graph, heads, analysis.canonical,
                                                symbols)
    measured = measure(analysis, passes)
    costs, partition = measured.costs, measured.partition
    seen, params, tied, tensors = set(), [], 0.0, []
    for i, u in enumerate(costs.units):
        new = [f for f in u.params if f not in seen]
        if i == len(costs.units) - 1:
            tied = sum(costs.param_bytes[f] for f in u.params if f in seen) / 4
        seen.update(new)
        params.append(sum(costs.param_bytes[f] for f in new) / 4)   # fp32 model: 4 bytes each
        tensors.append(float(len(new)))
    hidden = getattr(cfg, "hidden_size", None) or max(1, int(costs.cut_bytes[1] // (2 * seq * 4)))
    if heads is None:  # no config: tp must divide what the tp planner splits (1: no tp)
        heads = divides
        degrees = ", ".join(str(t) for t in range(1, divides + 1) if divides % t == 0)
        notes = list(notes) + [f"heads: no config; the sizes the tp planner splits (heads, "
                               f"features) are multiples of {divides}: tp in {{{degrees}}}"]
    vocab = getattr(cfg, "vocab_size", 0) or _table_rows(analysis.gm)
    vocab_sharded = any(r == "shard" for n, (r, _) in roles.items()
                        if n.target is torch.ops.aten.embedding.default)
    moe, grouped, expert_flops, expert_sites = _moe_layers(analysis.gm, partition.unit_of,
                                                           costs.param_bytes, symbols, seq)
    sites = {**sites, **expert_sites}
    inventory = GraphInventory(analysis.gm, partition.unit_of, len(costs.units), roles, sites, symbols,
                               seq, (loaded.loss_fn, analysis.captured.out_spec, loaded.batch,
                                     "shard" if vocab_sharded else "replicated"),
                               requires_grad_nodes(analysis.gm.graph), list(notes),
                               experts=grouped)
    return Workload(f"{Path(model_path).parent.name}/{Path(model_path).name}", seq, hidden, heads, vocab,
                    tuple(u.fwd_flops / 2 + expert_flops.get(i, 0.0) for i, u in enumerate(costs.units)),
                    tuple(u.bwd_flops / 2 + 2 * expert_flops.get(i, 0.0) for i, u in enumerate(costs.units)),
                    tuple(params), tied,
                    ends_tp_sharded=vocab_sharded, flash=True, attention="graph",
                    tensors=tuple(tensors), cut_bytes=tuple(c / 2 for c in costs.cut_bytes),
                    notes=tuple(notes), moe=moe,
                    balance=tuple(u.fwd_flops + u.bwd_flops for u in costs.units) if moe else (),
                    source=inventory)


def _moe_layers(gm, unit_of, param_bytes, symbols, seq) -> tuple[tuple, dict, dict, dict]:
    """The graph's mixture-of-experts layers (``analysis.experts``) as :class:`MoELayer`s,
    grouped-matmul node -> (E, the rows' width, tp sizes or None) for the inventory, and
    unit -> forward FLOPs of its grouped matmuls per sequence (the graph's cost model counts none: the op is opaque to it). Per
    sequence: top-k = rows / tokens at one sequence of ``seq`` tokens; a row's elements from
    the rows entering the region; and the tp f / g sites around each layer tp can split
    (``analysis/expert_ffn.py``: node -> "ef" | "eg")."""
    nodes = {n.name: n for n in gm.graph.nodes}
    subs = {sym: (1 if kind == "batch" else seq) for sym, kind in symbols.items()}
    layers, grouped, flops, sites = [], {}, {}, {}
    for layer in find_expert_layers(gm.graph)[0]:
        first = nodes[layer.matmuls[0]]
        ffn = expert_ffn(gm.graph, layer)   # what plan_expert_tp decides the tp split from
        sizes = (*ffn.widths.values(), *(p for parts in ffn.parts.values() for p in parts or ()),
                 *(size for *_, size in ffn.sizes))
        entering = nodes[layer.inputs[0]].meta["val"] if layer.inputs else first.meta["val"]
        width = 1
        for d in entering.shape[1:]:
            width *= concrete(d, subs)
        for name in layer.matmuls:
            node = nodes[name]
            grouped[node] = (layer.num_experts, width, None if ffn.blocker else tuple(sizes))
            rows_in = _rows_in(node)
            out = node.meta["val"]
            flops[unit_of[node]] = flops.get(unit_of[node], 0.0) + 2.0 * concrete(out.shape[0], subs) \
                * concrete(out.shape[1], subs) * concrete(rows_in.meta["val"].shape[1], subs)
        rows = concrete(first.meta["val"].shape[0], subs)
        if not ffn.blocker:   # tp's f on the rows entering the experts, g on their output
            sites[_rows_in(first)] = "ef"
            sites[nodes[layer.matmuls[-1]]] = "eg"
        layers.append(MoELayer(unit_of[first], layer.num_experts, rows / seq,
                               sum(param_bytes.get(w, 0) for w in layer.weights) / 4, float(width),
                               layer.module, tuple(sizes), ffn.blocker))
    return tuple(layers), grouped, flops, sites


def _rows_in(node):
    """A grouped matmul's rows operand (the 2-D floating input)."""
    return next(a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
                and a.meta["val"].dim() == 2 and a.meta["val"].is_floating_point())


def _table_rows(gm) -> int:
    """The rows of the largest table an ``aten.embedding`` reads (the vocabulary of a model
    file without a config, for the logits the loss keeps); 0 for none."""
    rows = [int(n.args[0].meta["val"].shape[0]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.embedding.default
            and isinstance(n.args[0], torch.fx.Node) and "val" in n.args[0].meta]
    return max(rows, default=0)


def _symbols(gm) -> dict:
    """The sympy symbols of the batch (dim 0) and sequence (dim 1) of the graph's inputs."""
    out = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            for dim, kind in ((0, "batch"), (1, "seq")):
                if val.dim() > dim and isinstance(val.shape[dim], torch.SymInt):
                    for sym in val.shape[dim].node.expr.free_symbols:
                        out.setdefault(sym, kind)
    return out


def _meta_batch(batch, seq):

    def one(t):
        shape = [2] + list(t.shape[1:])
        if seq and t.dim() >= 2:
            shape[1] = seq
        return torch.zeros(shape, dtype=t.dtype, device="meta")
    return {k: one(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(one(v) for v in batch)
