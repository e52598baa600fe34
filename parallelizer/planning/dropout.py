"""Which random stream each dropout of the captured graph draws from (Megatron-LM, Shoeybi
et al. 2019, §3: "dropout ... in the model parallel regions" draws per-rank masks, the rest
the same mask on every tp rank; Korthikanti et al. 2022, §4.2, likewise for the
sequence-parallel regions), and how each other random op draws (:func:`plan_random_ops`:
from the stream the tp ranks share, drawn whole and sliced where its output is sharded).

Reads the graph and the sharding placements of the tp planner, never changes the graph; the
``rng_streams`` pass (``passes/dropout.py``) applies the decision, the emitted program's
``runtime/rng.py`` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis.graph_facts import module_path, source_line
from ..analysis.sharding.placements import PerOutput, is_replicated, shard_dim
from ..errors import PlanError
from ..plan.parallel_plan import DROPOUT_OPS, RANDOM_OPS, REPLICATED, TP_LOCAL


@dataclass(frozen=True)
class DropoutSite:
    """One dropout: graph node name, the module that called it (FQN, "" at the root), the
    ATen op, its probability (None when not a constant) and the stream it draws from."""
    node: str
    module: str
    op: str
    p: float | None
    stream: str


def plan_dropout(graph: fx.Graph, placements: dict,
                 redistributions=()) -> tuple[DropoutSite, ...]:
    """Every dropout node of ``graph`` that draws (p > 0 or not a constant, train not False)
    with its stream: ``tp`` when its input (the query of an SDPA) is sharded over tp as the
    op reads it, else ``replicated``. ``placements``: node name -> placement, from sharding
    propagation (empty at tp = 1); ``redistributions`` (plan.decisions.Redistribution): an
    input all-gathered for this op is read replicated, so the op computes the whole tensor
    on every rank and must draw one mask (per-rank masks would back-propagate every rank's
    gradient of the whole through its own mask, not the one the kept output used)."""
    gathered = {(r.producer, reader) for r in redistributions if r.kind == "all_gather"
                for reader in r.readers}
    sites = []
    for node in graph.nodes:
        op = str(node.target) if node.op == "call_function" else ""
        if op not in DROPOUT_OPS or not _draws(node, op):
            continue
        x = node.args[0]
        sharded = (isinstance(x, fx.Node) and not is_replicated(placements.get(x.name))
                   and (x.name, node.name) not in gathered)
        p = _probability(node, op)
        sites.append(DropoutSite(node.name, _module(node), op,
                                 float(p) if isinstance(p, (int, float)) else None,
                                 TP_LOCAL if sharded else REPLICATED))
    return tuple(sites)


@dataclass(frozen=True)
class RandomSite:
    """One random op outside dropout (:data:`RANDOM_OPS`): graph node name, module FQN, the
    ATen op, its stream (the replicated one: every tp rank draws the same values), the tp
    shard dim of its output (None: replicated over tp; ``d``: drawn whole, this rank's
    block of dim ``d`` kept) and the model's source line."""
    node: str
    module: str
    op: str
    stream: str
    dim: int | None
    line: str


def plan_random_ops(graph: fx.Graph, placements: dict, tp: int) -> tuple[RandomSite, ...]:
    """Every random op of ``graph`` outside a dropout (ATen's ``nondeterministic_seeded``
    tag: the ``torch.rand`` of a stochastic-depth drop path, ``bernoulli``, ``randn`` noise,
    Gumbel noise from ``exponential_``) with how the program draws it (Megatron-LM's
    model-parallel RNG, Shoeybi et al. 2019 §3): from the stream shared by the tp ranks, so a
    value replicated over tp stays equal on every rank; a draw sharded over tp (its output's
    placement in ``placements``) is drawn whole from that stream and each rank keeps its
    block, so every tp degree draws the values of the one-rank program.

    At tp = 1 every site draws from the one stream, in graph order; an op outside
    :data:`RANDOM_OPS` is left as it is there (on the default generator).

    Raises:
        PlanError (tp > 1, naming the op, the module FQN and the model's source line, with
        the fix): an op outside :data:`RANDOM_OPS` (no stream and no --verify stand-in for
        it: ``randint_like`` with a tensor ``high``); a sharded draw that cannot be drawn whole (it
        reads its input's values, which a rank holds only its block of; a shard dim whose
        global size is not a constant multiple of tp; an output with no single placement).
    """
    sites = []
    for node in graph.nodes:
        target = node.target
        if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or str(target) in DROPOUT_OPS
                or torch.Tag.nondeterministic_seeded not in target.tags
                or not _draws_random(node)):
            continue
        op = str(target)
        if op not in RANDOM_OPS:
            if tp > 1:
                raise _refusal(node, tp, _UNKNOWN)
            continue
        dim = _shard_dim(node, placements.get(node.name), op, tp)
        sites.append(RandomSite(node.name, _module(node), op, REPLICATED, dim,
                                source_line(node) or ""))
    return tuple(sites)


_UNKNOWN = ("has no random stream here (it is none of the random ops the program draws from "
            "the tp-shared stream) and no fixed stand-in for --verify")


def _shard_dim(node: fx.Node, place, op: str, tp: int):
    """None for a draw replicated over tp; the dim of a sharded one that can be drawn whole
    (a "template" op over an even Shard(d) of a constant size); raises otherwise."""
    if isinstance(place, PerOutput) and len(set(place.outputs)) == 1:
        place = place.outputs[0]  # rrelu_with_noise_functional: (output, noise) alike
    if is_replicated(place):
        return None
    d = shard_dim(place)
    if d is not None and RANDOM_OPS[op] != "template":
        raise _refusal(node, tp, f"draws a tensor sharded over tp (Shard({d})) from the values "
                                 f"of its input, which each tp rank holds only its block of, "
                                 f"so no rank can draw its block of the unsharded draw")
    size = None if d is None else _shape(node)[d]
    if not isinstance(size, int) or size % tp:
        what = (f"no single placement over tp ({place})" if d is None else
                f"dim {d} of size {size} sharded over tp, not a constant multiple of {tp}")
        raise _refusal(node, tp, f"draws a tensor with {what}: its full draw cannot be cut "
                                 f"into the ranks' blocks")
    return d


def _shape(node: fx.Node):
    v = node.meta["val"]
    return (v[0] if isinstance(v, (tuple, list)) else v).shape


def _refusal(node: fx.Node, tp: int, why: str) -> PlanError:
    where = source_line(node)
    fix = ("Draw it with torch.rand / randn / randint (with an int high) or their *_like, "
           "which the program draws from the tp-shared stream, make it inactive in "
           "build_model" if why is _UNKNOWN else
           "Draw it from a shape rather than from values (torch.rand_like(p) < p for "
           "torch.bernoulli(p)), on a value replicated over tp, make it inactive in build_model")
    return PlanError(
        f"mesh.tp={tp}: {node.target} ({node.name}) in {module_path(node) or 'the root module'}"
        f"{f' at {where}' if where else ''} {why}. {fix}, or compile with mesh.tp=1")


def _draws_random(node: fx.Node) -> bool:
    """False for a tagged op that draws nothing as called: an RNN, SDPA kernel or rrelu
    with its dropout / training off (constants)."""
    train = _argument(node, "training", _argument(node, "train", True))
    p = _argument(node, "dropout", _argument(node, "dropout_p", 1.0))
    return train is not False and not (isinstance(p, (int, float)) and p == 0)


def _argument(node: fx.Node, name: str, absent=None):
    """Argument ``name`` of ``node``'s ATen op as called (its schema default if not passed);
    ``absent`` when the op has no such argument."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name != name:
            continue
        if name in node.kwargs:
            return node.kwargs[name]
        if i < len(node.args) and not a.kwarg_only:
            return node.args[i]
        return a.default_value if a.has_default_value() else absent
    return absent


def _probability(node: fx.Node, op: str):
    pos, kw = DROPOUT_OPS[op]
    if kw in node.kwargs:
        return node.kwargs[kw]
    return node.args[pos] if len(node.args) > pos else 0.0


def _draws(node: fx.Node, op: str) -> bool:
    p = _probability(node, op)
    if isinstance(p, (int, float)) and p == 0:
        return False
    return _argument(node, "train", True) is not False


def _module(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else ""


def describe(sites) -> list[str]:
    """report.md lines: one per stream, naming the modules (first few) and probabilities."""
    lines = []
    for stream in (REPLICATED, TP_LOCAL):
        mine = [s for s in sites if s.stream == stream]
        if not mine:
            continue
        names = [f"{s.module or s.node} (p={'?' if s.p is None else f'{s.p:g}'})" for s in mine]
        more = f", ... ({len(names) - 6} more)" if len(names) > 6 else ""
        what = ("same mask on every tp rank" if stream == REPLICATED
                else "each tp rank its own mask (sharded over tp)")
        lines.append(f"{stream} stream, {what}: {len(mine)} site(s): {', '.join(names[:6])}{more}")
    return lines


def describe_random(sites) -> list[str]:
    """report.md lines for the random ops outside dropout: those replicated over tp, those
    drawn whole and sliced (first few modules and ops each)."""
    lines = []
    for sharded, what in ((False, "the same values on every tp rank"),
                          (True, "sharded over tp: drawn whole, each rank keeps its block")):
        mine = [s for s in sites if (s.dim is not None) == sharded]
        if not mine:
            continue
        names = [f"{s.module or s.node} ({s.op.split('.')[1]})" for s in mine]
        more = f", ... ({len(names) - 6} more)" if len(names) > 6 else ""
        lines.append(f"{REPLICATED} stream, random ops outside dropout, {what}: {len(mine)} "
                     f"site(s): {', '.join(names[:6])}{more} (--verify: fixed stand-ins)")
    return lines
