"""Read-only cost facts of a captured graph, for the pipeline partitioner.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (torch's own formulas): each
node that can reach a registered formula (a registered op, or a composite such as
``aten.linear`` / ``scaled_dot_product_attention`` that decomposes into one) runs once on
fresh FakeTensors of the example's concrete shapes, forward then ``autograd.grad`` with
respect to the inputs that require grad, so the backward count is what autograd runs
(``linear``: 2x forward when both input and weight need grads, 1x for the first layer).
Identical (op, shapes) pairs are counted once (all blocks of a Llama share them), which
keeps a 70B graph under a second. On CPU, SDPA dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, which torch's registry lacks; it is
mapped to torch's own SDPA formulas (``sdpa_flop`` / ``sdpa_backward_flop``).
"""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (GuardOnDataDependentSymNode, guarding_hint_or_throw,
                                                   optimization_hint)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop, sdpa_flop

from ..plan.dtypes import differentiable
from .costs import PipelineCosts, UnitCost
from .graph_facts import RUNTIME_DEVICE, aten, is_tensor, module_calls
from .partition import GraphPartition
from .recompute import Recompute

# the module-level names are already shape-wrapped; custom_mapping wraps again
_CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop.__wrapped__}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def collect_costs(gm: fx.GraphModule, blocks: tuple[str, ...], canonical: dict,
                  partition=None) -> PipelineCosts:
    """Per-unit FLOPs, parameters and cut bytes of ``gm`` (units: before, blocks, after).

    Args:
        blocks: block FQNs in execution order (``planning.pipeline.find_blocks``).
        canonical: tied-weight name -> canonical FQN (names not in it are canonical).
        partition: ``gm``'s :class:`~parallelizer.analysis.partition.GraphPartition`
            (computed here when None).
    """
    partition = partition or GraphPartition.of(gm.graph, blocks)
    unit_of, child_of = partition.unit_of, partition.child_of
    atom_of, runs = _atoms(gm.graph, unit_of, child_of)
    n_units, n_atoms = len(blocks) + 2, len(runs)
    counter = _FlopCounter(_requires_grad(gm.graph))
    fwd, bwd = [0] * n_units, [0] * n_units
    afwd, abwd = [0] * n_atoms, [0] * n_atoms
    params: list[list] = [[] for _ in range(n_units)]
    aparams: list[list] = [[] for _ in range(n_atoms)]
    param_bytes = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node in unit_of:
            f, b = counter.count(node)
            fwd[unit_of[node]] += f
            bwd[unit_of[node]] += b
            afwd[atom_of[node]] += f
            abwd[atom_of[node]] += b
        if node.op == "get_attr" and node.target != RUNTIME_DEVICE:
            t = attrgetter(node.target)(gm)
            if not isinstance(t, torch.nn.Parameter):
                continue
            fqn = canonical.get(node.target, node.target)
            param_bytes[fqn] = t.numel() * t.element_size()
            for u in sorted({unit_of[user] for user in node.users if user in unit_of}):
                if fqn not in params[u]:
                    params[u].append(fqn)
            for a in sorted({atom_of[user] for user in node.users if user in atom_of}):
                if fqn not in aparams[a]:
                    aparams[a].append(fqn)
    names = ([f"<before {blocks[0]}>" if blocks else "<before>"] + list(blocks)
             + [f"<after {blocks[-1]}>" if blocks else "<after>"])
    units = tuple(UnitCost(n, fwd[i], bwd[i], tuple(params[i])) for i, n in enumerate(names))
    atom_cuts = _cut_bytes(gm.graph, atom_of, n_atoms, partition.recompute)
    parts, part_cuts = [], []
    for u in range(1, len(blocks) + 1):
        mine = [a for a, (au, _) in enumerate(runs) if au == u]
        split = len(mine) > 1
        parts.append(tuple(UnitCost(runs[a][1], afwd[a], abwd[a], tuple(aparams[a]))
                           for a in mine) if split else ())
        part_cuts.append(tuple(atom_cuts[a - 1] for a in mine[1:]) if split else ())
    return PipelineCosts(units, _cut_bytes(gm.graph, unit_of, n_units, partition.recompute), param_bytes,
                         _batch_shape(gm.graph), tuple(counter.notes), tuple(parts),
                         tuple(part_cuts), module_calls(gm.graph, blocks))


def _atoms(graph: fx.Graph, unit_of: dict, child_of: dict) -> tuple[dict, list]:
    """node -> index of its (unit, child) run in graph order, and the runs: units split
    into their parts where ``child_of`` has them."""
    index: dict = {}
    out = {}
    for node in graph.nodes:
        if node in unit_of:
            out[node] = index.setdefault((unit_of[node], child_of.get(node)), len(index))
    return out, list(index)


def _cut_bytes(graph: fx.Graph, unit_of: dict, n_units: int, recompute: Recompute) -> tuple[int, ...]:
    """Bytes sent across each cut: tensors defined at or before unit i and used after it,
    less those the next stage recomputes (``recompute.Recompute.sent``, as
    ``split_stages`` decides)."""
    crossing: list[list] = [[] for _ in range(n_units - 1)]
    for n in graph.nodes:
        if n not in unit_of or not is_tensor(n):
            continue
        uses = [n_units if u.op == "output" else unit_of.get(u, -1) for u in n.users]
        last = min(max(uses, default=-1), n_units - 1)
        for cut in range(unit_of[n], last):
            crossing[cut].append(n)
    return tuple(sum(_bytes(n.meta["val"]) for n in recompute.sent(c)) for c in crossing)


def _batch_shape(graph: fx.Graph) -> tuple[int, ...]:
    first = next((n for n in graph.nodes if n.op == "placeholder" and is_tensor(n)), None)
    return tuple(_hint(s) for s in first.meta["val"].shape) if first is not None else ()


def _hint(size) -> int:
    """A concrete size: the example's value of a symbolic size (SymInt), also of an
    expression of data-dependent sizes that the capture's checks fix (JetMoE's expert sizes
    sum to tokens x top_k).

    Raises:
        _DataDependent: the size depends on values (an unbacked SymInt from ``.tolist()``,
            ``nonzero``), so the example has no value for it.
    """
    if isinstance(size, torch.SymInt):
        try:
            return int(guarding_hint_or_throw(size))
        except GuardOnDataDependentSymNode as e:
            raise _DataDependent(str(size)) from e
    return int(size)


def _bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``; a data-dependent size counts as torch's estimate for memory planning
    (``optimization_hint``: 8192 unless the shape env says better), so a cut that would
    send such a tensor looks dear rather than free."""
    n = 1
    for s in t.shape:
        try:
            n *= _hint(s)
        except _DataDependent:
            n *= int(optimization_hint(s))
    return n * t.element_size()


class _FlopCounter:
    """Forward/backward FLOPs of one node, cached by (op, argument shapes)."""

    def __init__(self, requires_grad: set):
        self.requires_grad = requires_grad
        self.mode = FakeTensorMode()
        self.cache: dict = {}
        self.notes: list[str] = []

    def count(self, node: fx.Node) -> tuple[int, int]:
        op = node.target
        if not isinstance(op, torch._ops.OpOverload) or not _may_count(op):
            return 0, 0
        try:
            args, kwargs = tree_map(self._concrete, (node.args, node.kwargs))
        except _NoValue:
            return 0, 0
        except _DataDependent as e:  # no example value to count with (MoE expert sizes)
            self.notes.append(f"FLOPs of {node.name} ({op}) not counted: its input's size {e} "
                              f"depends on values")
            return 0, 0
        key = (op, _key((args, kwargs)))
        if key not in self.cache:
            try:
                self.cache[key] = self._run(op, args, kwargs)
            except Exception as e:  # an op that fake tensors of fresh shapes cannot run
                self.notes.append(f"FLOPs of {node.name} ({op}) not counted: {type(e).__name__}: {e}")
                self.cache[key] = (0, 0)
        return self.cache[key]

    def _concrete(self, a):
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr" and a.target == RUNTIME_DEVICE:
            return torch.device("cpu")
        if "val" not in a.meta:
            raise _NoValue(a.name)
        grad = a in self.requires_grad

        def fresh(v):
            if isinstance(v, torch.SymInt):
                return _hint(v)
            if not isinstance(v, torch.Tensor):
                return v
            with self.mode:
                t = torch.empty([_hint(s) for s in v.shape], dtype=v.dtype, device="cpu")
            return t.requires_grad_(grad and differentiable(v.dtype))

        return tree_map(fresh, a.meta["val"])

    def _run(self, op, args, kwargs) -> tuple[int, int]:
        with self.mode, FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as fc:
            out = op(*args, **kwargs)
            fwd = fc.get_total_flops()
            inputs = [t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            outs = [t for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
            if fwd and inputs and outs:
                torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
            return int(fwd), int(fc.get_total_flops() - fwd)


def _requires_grad(graph: fx.Graph) -> set:
    """Nodes whose value autograd tracks: trainable parameters and floating-point or complex
    results computed from one (export's node values do not carry requires_grad past the inputs)."""
    out = set()
    for n in graph.nodes:
        # a tuple of tensors too (unbind, split), read by getitem
        vals = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        if not any(differentiable(v.dtype) for v in vals):
            continue
        if n.op == "get_attr" and any(v.requires_grad for v in vals):
            out.add(n)
        elif n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


class _NoValue(Exception):
    pass


class _DataDependent(Exception):
    """A size the example has no value for (an unbacked SymInt)."""


def _may_count(op: torch._ops.OpOverload) -> bool:
    """True when a FLOP formula can see this op: registered, or a composite that decomposes."""
    return (op.overloadpacket in flop_registry or op in _CPU_SDPA
            or op.overloadpacket in _CPU_SDPA or op.has_kernel_for_dispatch_key(_COMPOSITE))


def _key(tree) -> tuple:
    def one(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.requires_grad)
        return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else repr(x)
    flat, spec = tree_flatten(tree)
    return tuple(one(x) for x in flat) + (str(spec),)
