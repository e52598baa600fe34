"""A captured model's kernels per unit, at any micro-batch size: what ``capture.py`` hands the
step-time model for a model file.

The captured graph's batch and sequence sizes are symbols (``torch.export`` with dynamic
dims), so every node's shapes are known for any micro-batch ``b``: each node runs forward and
backward on FakeTensors of those shapes under :class:`~parallelizer.advisor.kernels.OpRecorder`
(identical (op, shapes) pairs once: all blocks of a Llama share them), and so does the
model's ``loss_fn`` on the graph's outputs (the loss is part of the step). The tensor-parallel
role of every node comes from the compiler's own planners (``planning.tp.plan_tp`` and
``plan_vocab`` at the smallest tp the model allows), and so do the Megatron f / g sites
whose collectives the step pays: one per distinct input of the column-parallel linears (f),
one per row-parallel output (g), the vocab-parallel embedding (g) and head (f).

A grouped matmul of a mixture-of-experts layer (``experts``: node -> E) is not run: its
rows per expert are data (the router's choice), so its kernels are written out at balanced
routing (:func:`~parallelizer.advisor.kernels.grouped_mm`: rows / E per expert), which
expert parallelism regroups per rank (``Kernel.regrouped``).
"""
from __future__ import annotations

from typing import Optional

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..analysis.graph_facts import RUNTIME_DEVICE
from ..errors import PlanError
from ..plan.dtypes import differentiable
from .kernels import grouped_mm, record


@dataclass(frozen=True)
class UnitKernels:
    """One unit's kernels for one microbatch at tp = 1: (role, split size, kernel) triples,
    forward and backward, and its tensor-parallel sites: (``f`` | ``g``, bytes)."""
    fwd: tuple
    bwd: tuple
    sites: tuple = ()


@dataclass
class GraphInventory:
    """Per-unit kernels of a captured graph (see the module docstring), cached by micro-batch."""
    gm: fx.GraphModule
    unit_of: dict
    n_units: int
    roles: dict                      # node -> (role, size)
    sites: dict                      # node -> "f" | "g" (a value whose collective tp pays)
    symbols: dict                    # sympy symbol -> "batch" | "seq"
    seq: int
    loss: object = None              # (loss_fn, out_spec, batch template, role) or None
    requires_grad: set = field(default_factory=set)
    notes: list = field(default_factory=list)
    # grouped-matmul node -> (experts E, the rows' width, tp_sizes or None when tp cannot split it)
    experts: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict)

    def units(self, b: int) -> tuple[UnitKernels, ...]:
        if b not in self._cache:
            self._cache[b] = self._build(b)
        return self._cache[b]

    def _build(self, b: int) -> tuple[UnitKernels, ...]:
        subs = {sym: (b if kind == "batch" else self.seq) for sym, kind in self.symbols.items()}
        mode = FakeTensorMode()
        seen: dict = {}
        fwd = [[] for _ in range(self.n_units)]
        bwd = [[] for _ in range(self.n_units)]
        sites = [[] for _ in range(self.n_units)]
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or node not in self.unit_of:
                continue
            u = self.unit_of[node]
            role = self.roles.get(node, ("replicated", 0))
            f, bk = (self._grouped(node, subs) if node in self.experts
                     else self._node(node, subs, mode, seen))
            fwd[u] += [(role[0], role[1], k) for k in f]
            bwd[u] += [(role[0], role[1], k) for k in bk]
            if node in self.sites:
                sites[u].append((self.sites[node], _val_bytes(node, subs)))
        if self.loss is not None:
            f, bk = self._loss(subs, mode, b)
            fwd[-1] += [(self.loss[3], 0, k) for k in f]
            bwd[-1] += [(self.loss[3], 0, k) for k in bk]
        return tuple(UnitKernels(tuple(a), tuple(c), tuple(s)) for a, c, s in zip(fwd, bwd, sites))

    def _node(self, node, subs, mode, seen):
        try:
            key = (node.target, _key(tree_map(partial(self._shape_of, subs), (node.args, node.kwargs))))
        except _NoValue:
            return [], []
        if key not in seen:
            args, kwargs = tree_map(partial(self._fresh, subs, mode), (node.args, node.kwargs))
            weights = [t for a, t in zip(node.args, args) if isinstance(a, fx.Node)
                       and a.op == "get_attr" and isinstance(t, torch.Tensor)]
            try:
                with mode:
                    seen[key] = record(lambda *a: node.target(*a, **kwargs), list(args), weights)
            except Exception as e:  # an op fresh fake tensors cannot run: its kernels unknown
                self.notes.append(f"kernels of {node.name} ({node.target}) not counted: "
                                  f"{type(e).__name__}: {e}")
                seen[key] = ([], [])
        return seen[key]

    def _grouped(self, node, subs) -> tuple[list, list]:
        """A grouped matmul's kernels at balanced routing (module docstring): rows (S, k) x
        (E, k, n) -> (S, n)."""
        out = node.meta["val"]
        rows = next(a for a in node.all_input_nodes
                    if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() == 2
                    and a.meta["val"].is_floating_point())
        experts, hidden, sizes = self.experts[node]
        n, k = concrete(out.shape[1], subs), concrete(rows.meta["val"].shape[1], subs)
        ffn = 0.0 if sizes is None else (k if n == hidden else n)   # the dim that is not the rows'
        f, b = grouped_mm(experts, concrete(out.shape[0], subs), n, k, ffn, sizes or ())
        return [f], list(b)

    def _shape_of(self, subs, a):
        """What identifies an argument's fresh value: shapes, dtypes and requires_grad."""
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr" and a.target == RUNTIME_DEVICE:
            return "device"
        if "val" not in a.meta:
            raise _NoValue(a.name)
        grad = a in self.requires_grad

        def one(v):
            if isinstance(v, torch.SymInt):
                return concrete(v, subs)
            if isinstance(v, torch.Tensor):
                return ("T", tuple(concrete(s, subs) for s in v.shape), str(v.dtype),
                        grad and differentiable(v.dtype), a.op == "get_attr")
            return v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)
        return tree_map(one, a.meta["val"])

    def _fresh(self, subs, mode, a):
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr" and a.target == RUNTIME_DEVICE:
            return torch.device("cpu")
        if "val" not in a.meta:
            raise _NoValue(a.name)
        grad = a in self.requires_grad

        def fresh(v):
            if isinstance(v, torch.SymInt):
                return concrete(v, subs)
            if not isinstance(v, torch.Tensor):
                return v
            with mode:
                t = torch.empty([concrete(s, subs) for s in v.shape], dtype=v.dtype, device="cpu")
            return t.requires_grad_(grad and differentiable(v.dtype))
        return tree_map(fresh, a.meta["val"])

    def _loss(self, subs, mode, b):
        loss_fn, out_spec, template, _ = self.loss
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        flat = tree_flatten(out_node.args[0])[0]
        try:
            with mode:
                outs = [self._fresh_out(v, subs, mode) for v in flat]
                batch = tree_map(lambda t: torch.zeros(_batch_shape(t, b, self.seq), dtype=t.dtype)
                                 if isinstance(t, torch.Tensor) else t, template)
                n = len(outs)

                def fn(*xs):
                    return loss_fn(tree_unflatten(list(xs[:n]), out_spec), batch)
                return record(fn, outs)
        except Exception as e:
            self.notes.append(f"kernels of loss_fn not counted: {type(e).__name__}: {e}")
            return [], []

    def _fresh_out(self, v, subs, mode):
        if not isinstance(v, fx.Node):
            return v
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return val
        t = torch.empty([concrete(s, subs) for s in val.shape], dtype=val.dtype, device="cpu")
        return t.requires_grad_(differentiable(val.dtype))


class _NoValue(Exception):
    pass


def concrete(size, subs: dict) -> int:
    """A size of the captured graph at ``subs`` (symbol -> value; other symbols: their hint)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    env = size.node.shape_env
    values = {s: subs.get(s, _hint(env, s)) for s in expr.free_symbols}
    return int(expr.xreplace(values))


def _batch_shape(t: torch.Tensor, b: int, seq: int) -> list:
    """An example-batch tensor's shape with dim 0 the micro-batch and dim 1 the sequence."""
    return [b, seq][:t.dim()] + list(t.shape[2:])


def _hint(env, sym):
    table = getattr(env, "backed_var_to_val", None) or env.var_to_val
    return table.get(sym)


def _val_bytes(node, subs) -> float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    n = 1
    for s in val.shape:
        n *= concrete(s, subs)
    return float(n * val.element_size())


def _key(tree) -> tuple:
    flat, spec = tree_flatten(tree)
    return tuple(x if isinstance(x, (int, float, bool, str, type(None), tuple)) else repr(x)
                 for x in flat) + (str(spec),)


def requires_grad_nodes(graph: fx.Graph) -> set:
    """Nodes whose value autograd tracks: trainable parameters and floating-point or complex results
    computed from one (export's node values do not carry requires_grad past the inputs)."""
    out = set()
    for n in graph.nodes:
        vals = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        if not any(differentiable(v.dtype) for v in vals):
            continue
        if n.op == "get_attr" and any(v.requires_grad for v in vals):
            out.add(n)
        elif n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def tensor_roles(graph: fx.Graph, heads: Optional[int], canonical: dict,
                 symbols: dict) -> tuple[dict, dict, list, int]:
    """node -> (role, split size), node -> "f" | "g" from the compiler's tp and vocab
    planners at the smallest tp degree dividing ``heads`` (module docstring; 2 where the
    heads are not known: a model file without a config), the notes, and the number every tp
    degree that shards the planned groups divides (``TPDecision.divides``: the heads where
    the planner found them). With no such degree, or when the planners refuse, every node is
    replicated (a note says why) and that number is 1."""
    from ..planning.tp import plan_tp
    from ..planning.vocab import plan_vocab
    t0 = 2 if heads is None else next((t for t in range(2, heads + 1) if heads % t == 0), None)
    notes: list = []
    if t0 is None:
        return {}, {}, ["no tp degree divides the heads: every node costed as replicated"], 1
    try:
        tp = plan_tp(graph, t0)
        vocab = plan_vocab(graph, t0, "auto", canonical, tp)
    except PlanError as e:
        return {}, {}, [f"tensor parallelism not planned ({e}); every node costed as "
                        f"replicated"], 1
    roles: dict = {}
    sites: dict = {}
    seq_syms = {s for s, kind in symbols.items() if kind in ("batch", "seq")}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        roles[node] = _role(node, tp, vocab, seq_syms)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.linear.default:
            w = node.args[1].target if isinstance(node.args[1], fx.Node) else None
            if w in tp.row:
                sites[node] = "g"
            elif w in tp.column or w in vocab.heads:
                src = node.args[0]
                if isinstance(src, fx.Node) and src not in sites:
                    sites[src] = "f"
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            table = node.args[0].target if isinstance(node.args[0], fx.Node) else None
            if table is not None and canonical.get(table, table) in vocab.vocab:
                sites[node] = "g"
    return roles, sites, notes, (tp.divides or 1) if tp.column or tp.row else 1


def _role(node, tp, vocab, seq_syms) -> tuple[str, int]:
    if node.target is torch.ops.aten.linear.default and isinstance(node.args[1], fx.Node):
        w, val = node.args[1].target, node.args[1].meta.get("val")
        if val is not None and (w in tp.column or w in vocab.heads):
            return "column", int(val.shape[0])
        if val is not None and w in tp.row:
            return "row", int(val.shape[1])
    placement = tp.placements.get(node.name)
    if placement is not None and "Shard" in repr(placement):
        return "shard", 0
    if node.target is torch.ops.aten.embedding.default and isinstance(node.args[0], fx.Node) \
            and node.args[0].target in vocab.vocab:
        return "shard", 0
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) and
                                             s.node.expr.free_symbols & seq_syms for s in val.shape):
        return "seq", 0
    return "replicated", 0

