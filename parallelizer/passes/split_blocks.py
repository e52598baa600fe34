"""split_blocks pass: outline each block of a stage graph into its own submodule.

FSDP2's ``fully_shard`` and activation checkpointing act on module calls, so each block
(``model.layers.3``) becomes a ``call_module`` whose graph reads its own parameters under
their names relative to the block; together with the stage's parent path they keep the
original FQNs. A block is the contiguous run of nodes from its first to its last node
(nodes interleaved inside it go with it). Blocks whose runs overlap are not outlined; the
stage then is one FSDP unit, and the report says so.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from ..analysis.graph_facts import RUNTIME_DEVICE
from ..analysis.graph_facts import block_of, is_tensor
from ..frontend.vmap_regions import VMAP_LEVELS


@dataclass
class BlockGraph:
    fqn: str
    graph: fx.Graph
    targets: list = field(default_factory=list)  # get_attr targets relative to the block


def split_blocks(graph: fx.Graph, blocks: tuple[str, ...]) -> tuple[list[BlockGraph], list[str]]:
    """Outline ``blocks`` found in ``graph`` in place. Returns the block graphs and report lines."""
    _sink_block_reads(graph, blocks)
    runs = _runs(graph, blocks)
    spans = sorted(runs.values(), key=lambda r: r[0])
    if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
        return [], [f"blocks {', '.join(runs)} interleave; stage kept as one FSDP unit"]
    nodes = list(graph.nodes)
    out = []
    for fqn, (lo, hi) in runs.items():
        out.append(_outline(graph, nodes[lo:hi + 1], fqn))
    graph.lint()
    return out, []


def _sink_block_reads(graph: fx.Graph, blocks) -> None:
    """Move a block's get_attr that sits above its first user to just before it: export
    lifts tensor constants (Falcon's index tensors ``lifted_tensor_0``) and their reads land
    at the stage's top, where they would start the block's run before the previous block's."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        if n.op != "get_attr" or not n.users or \
                not any(n.target.startswith(b + ".") for b in blocks):
            continue
        first = min(n.users, key=lambda u: order[u])
        if order[first] > order[n] + 1:
            first.prepend(n)


def _runs(graph: fx.Graph, blocks) -> dict:
    runs = {}
    for i, node in enumerate(graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        b = block_of(node, blocks)
        if b is not None:
            lo, _ = runs.get(b, (i, i))
            runs[b] = (lo, i)
    return runs


def _outline(graph: fx.Graph, run: list, fqn: str) -> BlockGraph:
    prefix = fqn + "."
    inside, members = [], set()
    for n in run:
        foreign_attr = n.op == "get_attr" and not n.target.startswith(prefix) and n.target != RUNTIME_DEVICE
        # sizes computed only from the block's inputs stay in the parent, where later blocks
        # see them; a vmap level entered or left stays in its place among the block's ops
        hoisted_size = not is_tensor(n) and n.op == "call_function" and not (
            set(n.all_input_nodes) & members) and n.target not in VMAP_LEVELS
        if not (foreign_attr or hoisted_size):
            inside.append(n)
            members.add(n)
    inputs = []
    for n in inside:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in inside if any(u not in members for u in n.users)]
    sub = fx.Graph()
    env = {}
    for i, a in enumerate(inputs):  # positional names: identical blocks get identical source
        env[a] = sub.placeholder(f"input{i}")
        env[a].meta = dict(a.meta)
    targets = []
    for n in inside:
        if n.op == "get_attr":
            target = n.target[len(prefix):] if n.target.startswith(prefix) else n.target
            env[n] = sub.get_attr(target)
            targets.append(target)
        else:
            env[n] = sub.create_node(n.op, n.target, fx.map_arg(n.args, env.__getitem__),
                                     fx.map_arg(n.kwargs, env.__getitem__))
        env[n].meta = dict(n.meta)
    sub.output(tuple(env[o] for o in outputs) if len(outputs) != 1 else env[outputs[0]])
    sub.lint()
    with graph.inserting_after(run[-1]):
        call = graph.call_module(fqn, tuple(inputs))
    call.meta["nn_module_stack"] = {}
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in members)
    else:
        with graph.inserting_after(call):
            for i, o in enumerate(outputs):
                item = graph.call_function(operator.getitem, (call, i))
                o.replace_all_uses_with(item, delete_user_cb=lambda u, m=members: u not in m)
    for n in reversed(inside):
        graph.erase_node(n)
    return BlockGraph(fqn, sub, targets)
