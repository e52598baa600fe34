"""Pipeline cost model (data only): what each indivisible unit of the graph costs.

A *unit* is what a pipeline stage holds whole: everything before the first block
(embeddings), each block, everything after the last block (final norm, LM head). Costs are
for the example batch's shapes. ``analysis/graph_costs.py`` fills these from the captured
graph; the partitioner (``planning/pipeline.py``) and the report read them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    """One unit: ``name`` is the block FQN, or ``<before FIRST>`` / ``<after LAST>``.

    ``fwd_flops`` / ``bwd_flops``: floating-point operations of one forward / backward of
    the example batch, by ``torch.utils.flop_counter``'s formulas (matmul, convolution,
    attention; element-wise ops, norms and softmax count 0 there). ``params``: canonical
    FQNs of the parameters the unit reads.
    """
    name: str
    fwd_flops: int
    bwd_flops: int
    params: tuple[str, ...]

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs: the unit's share of a training step's compute."""
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True)
class PipelineCosts:
    """Costs of ``units`` = (before, block 0, ..., block n-1, after).

    ``cut_bytes[i]``: bytes of the activations that cross the cut between ``units[i]`` and
    ``units[i + 1]`` in forward (the same again as gradients in backward), for the example
    batch ``batch_shape``; tensors used two stages later count at every cut they cross, and
    those the next stage recomputes (``analysis.recompute``: masks, rotary tables) not at all.
    ``param_bytes``: bytes of each parameter (canonical FQN).
    """
    units: tuple[UnitCost, ...]
    cut_bytes: tuple[int, ...]
    param_bytes: dict
    batch_shape: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    # per block: its parts, one UnitCost per run of a direct child (name = the child's FQN),
    # () when the block cannot be cut inside (one child, or children's runs interleave)
    parts: tuple[tuple[UnitCost, ...], ...] = ()
    # per block: bytes crossing the cut before parts[b][j], at index j - 1
    part_cut_bytes: tuple[tuple[int, ...], ...] = ()
    # per block: how many times forward calls it (> 1: one module run as several layers
    # with the same weights, ALBERT's shared layer)
    block_calls: tuple[int, ...] = ()

    def block_parts(self) -> list[list[tuple[str, int, bool]]]:
        """``planning.pipeline.BlockParts`` of every block: (child FQN, FLOPs, offered) where
        a cut before the part is offered to the partitioner when no more bytes cross it
        than cross into the block (``cut_bytes[b]``), so that it adds no communication."""
        out = []
        for b, runs in enumerate(self.parts):
            cut = self.part_cut_bytes[b]
            out.append([(u.name, u.flops, j > 0 and cut[j - 1] <= self.cut_bytes[b])
                        for j, u in enumerate(runs)])
        return out

    @property
    def blocks(self) -> tuple[UnitCost, ...]:
        return self.units[1:-1]

    def stage_param_bytes(self, units: range) -> int:
        """Parameter bytes of a stage holding ``units`` (a tied weight counts once per stage)."""
        fqns = {f for i in units for f in self.units[i].params}
        return sum(self.param_bytes[f] for f in fqns)

    def stage_fqns(self, units: range) -> tuple[str, ...]:
        out: list = []
        for i in units:
            out += [f for f in self.units[i].params if f not in out]
        return tuple(out)
