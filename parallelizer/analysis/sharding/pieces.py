"""Column weights read in static pieces (issue 23, part 4): a parameter cut along its
output features before its linears, each piece read by its own linear. torch's
cross-attention (``nn.MultiheadAttention(q, kv, kv)``, ``nn.TransformerDecoderLayer``'s
``multihead_attn``) does ``w_q, w_kv = in_proj_weight.split([E, 2E])`` and the same for the
bias; with ``kdim``/``vdim`` it keeps q/k/v weights of their own and reads
``in_proj_bias.chunk(3)``.

A piece's linear is a column linear of its own: its output is a *raw* value under the
piece's key (:func:`part_key`, ``"w[lo:hi]"``), whose uses decide the piece's layout as a
whole weight's would (a ``unflatten(-1, (2, E))`` of the kv piece makes it ``fused [E,
E]``). The parameter's layout is the pieces' layouts side by side
(:func:`parallelizer.plan.layouts.side_by_side`, from ``Propagation.found_layouts``):
``fused [E, E, E]``, each rank holding its block of q, of k and of v, so a local
``split([E / tp, 2E / tp])`` hands every linear its own rows. The split sizes and slice
bounds on the weight path become those local lengths (:func:`piece_rule`).

Reads the graph, never changes it; the state lives in ``Propagation.parts``."""
from __future__ import annotations

import torch.fx as fx

from ..graph_facts import aten, module_path, shape
from ..linears import (PIECE_SLICES, PIECE_SPLITS, Linear, bias_operand, piece, piece_dim,
                       weight_source)
from .placements import CONFLICT, PerOutput, Shard
from .state import add_rewrite, local_at


def part_key(fqn: str, part) -> str:
    """The key a linear's raw output is recorded under: the weight FQN, or ``"w[lo:hi]"``
    for a piece ``(lo, hi)`` of it."""
    return fqn if part is None else f"{fqn}[{part[0]}:{part[1]}]"


def site_key(site: Linear) -> str:
    return part_key(site.weight, site.part)


def register(prop, site: Linear) -> None:
    """Record which range of its weight (and bias) the column linear ``site`` reads, under
    its key, for ``Propagation.found_layouts`` to lay the parameters out."""
    key = site_key(site)
    prop.part_of[key] = site.weight
    _read(prop, site.weight, int(site.features(site.out_dim)), site.part, key)
    b = bias_operand(site)
    if b is not None:
        _read(prop, site.bias, int(shape(weight_source(b, 1)[0])[0]), site.bias_part, key)


def _read(prop, param: str, n: int, part, key: str) -> None:
    reads = prop.parts.setdefault(param, (n, {}))[1]
    reads.setdefault(part or (0, n), set()).add(key)


def piece_rule(node: fx.Node, prop, tp: int, d: int, key: str, groups):
    """A split / chunk / slice / narrow of a column parameter along its sharded dim ``d``
    (:func:`parallelizer.analysis.linears.piece`): its sizes or bounds become the local
    lengths of the parameter's layout (``prop.layouts[key]``), or None when ``node`` is not
    one. Pieces a local op cannot spell (a ``chunk`` into unequal local pieces) conflict."""
    if node.target not in PIECE_SLICES | PIECE_SPLITS or piece_dim(node) != d:
        return None
    layout = prop.layouts.get(key)
    if node.target in PIECE_SLICES:
        cut = piece(node)
        if cut is None:
            return _cannot(prop, node, groups, f"{node.target} of {key} has bounds that are not "
                                               "constant ints")
        _, _, lo, hi = cut
        start = local_at(lo, layout, tp)
        if node.target is aten.narrow.default:
            add_rewrite(prop, node, 2, None, start)
            add_rewrite(prop, node, 3, None, local_at(hi, layout, tp) - start)
            return Shard(d)
        if lo:
            add_rewrite(prop, node, 2, None, start)
        if len(node.args) > 3 and node.args[3] is not None and hi < shape(node.args[0])[d]:
            add_rewrite(prop, node, 3, None, local_at(hi, layout, tp))
        return Shard(d)
    full = [int(v.shape[d]) for v in node.meta["val"]]
    bounds = [sum(full[:i]) for i in range(len(full) + 1)]
    local = [local_at(b, layout, tp) for b in bounds]
    lengths = [b - a for a, b in zip(local, local[1:])]
    if node.target is aten.split_with_sizes.default:
        for i, size in enumerate(lengths):
            add_rewrite(prop, node, 1, i, size)
    elif node.target is aten.split.Tensor and len(set(lengths[:-1])) == 1 \
            and lengths[-1] <= lengths[0]:
        add_rewrite(prop, node, 1, None, lengths[0])
    elif node.target is not aten.chunk.default or len(set(lengths)) > 1:
        return _cannot(prop, node, groups, f"the pieces of {key} are {lengths} elements on each "
                                           f"rank, which {node.target} cannot cut")
    return PerOutput(tuple(Shard(d) for _ in full))


def _cannot(prop, node, groups, reason):
    prop.conflicts.append((node.name, module_path(node), groups, reason))
    return CONFLICT
