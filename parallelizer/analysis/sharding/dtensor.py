"""Sharding rules from torch's DTensor op strategies (torch.distributed.tensor._ops), asked
at compile time first for every op whose table rule is only a placement map
(``DTENSOR_FIRST`` in :mod:`.rules`) and for every op the table has no rule for.

DTensor's ``ShardingPropagator`` holds a strategy for nearly every ATen op, maintained with
torch. We ask it the question our propagation asks: given these input placements on a 1-D
tp mesh, is there a strategy that takes them as they are, and what is the output placement?
An answer that needs a redistribution of an input, or gives a Partial output, is a
:class:`Wants`: a conflict for this run, which names the redistribution DTensor would insert
(:mod:`.redistribute` turns it into gathers, cuts and reductions for the next run; Partial
never flows on). Our placements
(:mod:`.placements`) are DTensor's ``Shard`` / ``Replicate``, handed over as they are. No DTensor is ever
created and nothing runs: the mesh is a ``DeviceMesh`` built without a process group
(``_init_backend=False``), and the specs carry the example's concrete sizes.

Argument dims are normalised before asking: torch 2.13's ``scan_strategy`` (cumsum) reads a
negative ``dim`` as is and answers Shard(-1) without a redistribution for a cumsum over the
sharded last dim (seen here; with ``dim=2`` it asks for Replicate).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..graph_facts import is_tensor
from .placements import CONFLICT, REPLICATE, PerOutput
from .state import add_rewrite, placement

NO_RULE = object()


@dataclass(frozen=True)
class Wants:
    """DTensor's answer when it takes the inputs only after a redistribution, or gives a
    Partial output: ``inputs`` the placement it wants for each tensor argument, in the
    order of :func:`tensor_args` (empty: none redistributed); ``out`` the output's placement once they are so; ``partial`` the output's reduce op
    ("sum", "avg", ...) when it is Partial, else None."""
    inputs: tuple
    out: object
    partial: Optional[str] = None

    def __eq__(self, other):  # a conflict, for the rules that compare with CONFLICT
        return other is CONFLICT or (isinstance(other, Wants) and self.inputs == other.inputs
                                     and self.out == other.out and self.partial == other.partial)

    def __hash__(self):
        return hash((self.inputs, self.partial))
_DIM_ARGS = {"dim", "dims", "dim0", "dim1", "start_dim", "end_dim"}
_OUTPUT_DIM_OPS = {torch.ops.aten.unsqueeze.default, torch.ops.aten.stack.default}


@functools.lru_cache(maxsize=None)
def _mesh(tp: int):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)


def _propagator():
    from torch.distributed.tensor import DTensor
    return DTensor._op_dispatcher.sharding_propagator


def _concrete(size):
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise ValueError("a size without a hint")
        return int(hint)
    return size


def _spec(node: fx.Node, prop, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    val = node.meta["val"]
    shape = torch.Size([_concrete(s) for s in val.shape])
    stride = torch.empty(shape, device="meta").stride()
    p = placement(prop, node)
    if not isinstance(p, (Shard, Replicate)):
        raise ValueError(f"a tensor placed {p}")  # not a DTensor placement: no question to ask
    return DTensorSpec(mesh, (p,), TensorMeta(shape, stride, val.dtype))


def _arg(a, prop, mesh):
    if isinstance(a, (list, tuple)):
        return type(a)(_arg(x, prop, mesh) for x in a)
    if isinstance(a, fx.Node):
        if is_tensor(a):
            return _spec(a, prop, mesh)
        return _concrete(a.meta.get("val"))
    return _concrete(a)


def _normalise_dims(op, args: list, kwargs: dict, rank: int) -> None:
    def norm(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return v % rank if rank else v
        if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            return type(v)(x % rank if rank else x for x in v)
        return v
    for i, arg in enumerate(op._schema.arguments):
        if arg.name not in _DIM_ARGS:
            continue
        if i < len(args):
            args[i] = norm(args[i])
        elif arg.name in kwargs:
            kwargs[arg.name] = norm(kwargs[arg.name])


def _out(spec):
    from torch.distributed.tensor import Replicate, Shard
    if spec is None:
        return REPLICATE
    p = spec.placements[0]
    if isinstance(p, Shard):
        return Shard(p.dim)  # a _StridedShard too: prop.strided tracks merged dims
    return REPLICATE if isinstance(p, Replicate) else CONFLICT


def dtensor_rule(node: fx.Node, prop, tp: int):
    """Output placement DTensor's strategy gives ``node`` for its inputs' placements
    (Shard | Replicate | PerOutput of them), CONFLICT when it would redistribute an input or
    yield a Partial, or NO_RULE when DTensor has no strategy for the op (or cannot be asked)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return NO_RULE
    from torch.distributed.tensor._op_schema import OpSchema
    mesh = _mesh(tp)
    try:
        args = [_arg(a, prop, mesh) for a in node.args]
        kwargs = {k: _arg(v, prop, mesh) for k, v in node.kwargs.items()}
        first = next((a for a in node.all_input_nodes if is_tensor(a)), None)
        rank = first.meta["val"].dim() if first is not None else 0
        # unsqueeze's and stack's dim counts the output's dims: -1 is the new last one
        _normalise_dims(op, args, kwargs, rank + (op in _OUTPUT_DIM_OPS))
    except Exception:  # noqa: BLE001 - an argument that cannot be made concrete
        return NO_RULE
    key = (op, tp, _key(args), _key(kwargs))
    if key not in _ANSWERS:
        if len(_ANSWERS) > _MAX_ANSWERS:
            _ANSWERS.clear()
        try:
            schema = OpSchema(op, tuple(args), kwargs, schema_info=_schema_info(op))
            result = _propagator().propagate_op_sharding_non_cached(schema)
            _ANSWERS[key] = (_answer(result, schema), _local_args(result, schema))
        except Exception:  # noqa: BLE001 - no strategy, or one that cannot take these args
            _ANSWERS[key] = (NO_RULE, ())
    answer, local_args = _ANSWERS[key]
    return answer if answer in (NO_RULE, CONFLICT) or _rewrite_local(node, prop, tp, local_args) \
        else CONFLICT


def _local_args(result, asked) -> tuple:
    """The non-tensor arguments DTensor rewrites from global to local values for the rank
    (``_sharding_prop.op_to_shape_and_stride_idx``: a view's or a ``new_*`` factory's
    shape; ``op_to_scalar_shape_adjuster``: group_norm's channels), as (index, asked, local)
    for each one that differs; the placements of the suggestion equal those asked, so it is
    no redistribution (:func:`_answer`)."""
    suggested, p = result.redistribute_schema, _propagator()
    if suggested is None or suggested.op != asked.op or _wanted(suggested) != _wanted(asked):
        return ()  # a redistribution, or another op (squeeze.dim asked as squeeze.dims)
    if asked.op not in p.op_to_shape_and_stride_idx and \
            asked.op not in getattr(p, "op_to_scalar_shape_adjuster", {}):
        return ()
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    return tuple((i, old, new) for i, (old, new) in
                 enumerate(zip(asked.args_schema, suggested.args_schema))
                 if not isinstance(old, DTensorSpec) and _key(old) != _key(new))


def _rewrite_local(node, prop, tp, local_args) -> bool:
    """Record each of DTensor's local arguments as a rewrite of ``node``'s constant (the tp
    pass sets it); False, recording none, when one cannot be written so: the value is
    symbolic in the graph (a size read at run time), or it is not the global one divided
    evenly by tp, the only local value the same on every rank."""
    rewrites = []
    for i, old, new in local_args:
        spelled = node.args[i]
        if isinstance(old, (list, tuple)):
            if not isinstance(new, (list, tuple)) or len(new) != len(old):
                return False
            for j, (o, n) in enumerate(zip(old, new)):
                if o != n and not (isinstance(spelled[j], int) and o == n * tp):
                    return False
                if o != n:
                    rewrites.append((i, j, n))
        elif isinstance(spelled, int) and old == new * tp:
            rewrites.append((i, None, new))
        else:
            return False
    for i, j, n in rewrites:
        add_rewrite(prop, node, i, j, n)
    return True


def _schema_info(op):
    """The op's RuntimeSchemaInfo, as DTensor's dispatcher passes it (torch 2.13
    _dispatch.py ``unwrap_to_op_info``): without it an op taking a list of tensors (cat,
    stack) is asked with the list unread, and answers with no redistribution whatever its
    inputs' placements (seen here: cat of a Shard(2) and a Replicate along dim 2 gave
    Replicate, needing nothing)."""
    p = _propagator()
    return p.op_to_schema_info.get(op) or p.op_to_schema_info_for_single_dim_strategy.get(op)


# Answers by (op, tp, argument specs): the repeated blocks of a model ask the same questions
# (one strategy search costs ~9 ms on this CPU; a 2-layer zoo model asks ~100, Llama-70B's 80
# blocks ~10k), so each distinct question is searched once per process.
_ANSWERS: dict = {}
_MAX_ANSWERS = 100_000


def _key(x):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    if isinstance(x, DTensorSpec):
        m = x.tensor_meta
        return ("spec", tuple(m.shape), tuple(m.stride), m.dtype, str(x.placements[0]))
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_key(v) for v in x)
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)


def _answer(result, asked=None):
    spec = result.output_spec
    redistribute = result.redistribute_schema is not None or getattr(
        result, "needs_redistribute", False)
    if redistribute and asked is not None and result.redistribute_schema is not None \
            and _wanted(result.redistribute_schema) == _wanted(asked):
        # the same placements under another overload (squeeze.dim asked as squeeze.dims):
        # nothing moves
        redistribute = False
    if isinstance(spec, (list, tuple)):
        outs = tuple(_out(s) for s in spec)
        if redistribute or CONFLICT in outs:
            return CONFLICT  # a multi-output op: no redistribution is asked for it
        return PerOutput(outs)
    out, partial = _out(spec), _partial(spec)
    if not redistribute and partial is None:
        return out
    if out == CONFLICT and partial is None:
        return CONFLICT
    wanted = () if not redistribute else _wanted(result.redistribute_schema)
    return Wants(wanted, REPLICATE if partial else out, partial)


def _partial(spec) -> Optional[str]:
    """The reduce op of a Partial output; a Partial subclass that reduces otherwise (a p-norm
    over the sharded dim: ``_NormPartial`` says "sum" but sums the ranks' norms raised to p,
    then takes the root) is named by its own repr, which no redistribution reduces (its
    inputs are gathered instead)."""
    from torch.distributed.tensor import Partial
    p = spec.placements[0] if spec is not None else None
    if not isinstance(p, Partial):
        return None
    return p.reduce_op if type(p) is Partial else repr(p)


def _wanted(schema):
    """The placement wanted for each tensor argument of a redistribute schema, in the order
    of :func:`tensor_args` (DTensor flattens a list of tensors into its arguments)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves
    leaves = tree_leaves(list(schema.args_schema)) + tree_leaves(list(schema.kwargs_schema.values()))
    return tuple(_out(x) for x in leaves if isinstance(x, DTensorSpec))


def tensor_args(node: fx.Node) -> list:
    """``node``'s tensor arguments in the order DTensor reads them (args, then kwargs, lists
    flattened): the order of :attr:`Wants.inputs`."""
    from torch.utils._pytree import tree_leaves
    leaves = tree_leaves(list(node.args)) + tree_leaves(list(node.kwargs.values()))
    return [a for a in leaves if isinstance(a, fx.Node) and is_tensor(a)]
