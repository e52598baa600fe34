"""The compiler's front end, shared with the layout advisor (``advisor/capture.py``):
:func:`analyse` captures the model and rewrites attention as eager runs it,
:func:`measure` the per-unit costs the pipeline planner and the advisor read. The steps that
follow are in ``compiler.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .analysis.costs import PipelineCosts
from .analysis.graph_costs import collect_costs
from .analysis.outputs import check_batch_is_dynamic, check_outputs_have_batch_dim
from .analysis.parameter_writes import check_parameter_writes
from .analysis.partition import GraphPartition, blocks_in_run_order
from .analysis.expert_modules import find_module_experts
from .frontend.capture import Captured, capture
from .frontend.modes import training_modes
from .passes.attention import apply_eager_attention
from .passes.cleanup import apply_cleanup
from .passes.explicit_sizes import apply_explicit_sizes
from .passes.manager import PassManager
from .passes.norms_over_projections import apply_norms_over_projections
from .passes.stack_experts import apply_stack_experts
from .planning.pipeline import find_blocks
from .planning.tensors import alias_map, tied_groups


@dataclass
class Analysis:
    """The model as the front end sees it (:func:`analyse`): its captured graph (rewritten
    in place by the passes that follow), tied-weight groups and their alias map (every name
    -> its canonical name), its blocks (module FQNs in execution order)."""
    model: torch.nn.Module
    captured: Captured
    groups: list
    canonical: dict
    blocks: tuple
    name: Path  # model.py, or "<in-memory model>": capture's and the program's messages
    attention: tuple = ()  # (module FQN, changes) of each SDPA call the attention pass rewrote
    stacked: dict = field(default_factory=dict)  # stacked expert FQN -> the experts' FQNs
    module_experts: tuple = ()  # expert lists the stack_experts pass could not stack (why)
    warnings: tuple = ()  # the model built in eval mode, compiled in training mode (modes.py)

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.captured.gm


def analyse(model: torch.nn.Module, batch, name: Path, passes: PassManager,
            pp: int = 1, ep: int = 1, microbatches: int = 1, dp: int = 1,
            tp: int = 1, branches: str = "refuse") -> Analysis:
    """Capture ``model`` (in training mode where it was built all in eval mode, else each
    module's mode as built: frontend/modes.py) on ``batch`` and rewrite attention as eager
    runs it, so that every planner sees what the model computes (SDPA's is_causal /
    enable_gqa for the mask and the repeated kv heads export materialised). At ``ep`` > 1 a
    list of expert modules becomes one grouped computation on stacked weights
    (passes/stack_experts.py); at ``tp`` > 1 a norm over a linear's whole output is written
    as the means it computes (passes/norms_over_projections.py). ``branches``:
    ``capture.data_dependent_branches`` (frontend/branches.py).

    Raises:
        CaptureError: the model cannot be captured. PlanError: ``pp`` > 1 and an output has
            no batch dim (the microbatches cannot be concatenated back).
    """
    modes = training_modes(model)
    captured = capture(model, batch, name, branches)
    if pp > 1 or microbatches > 1 or dp > 1:  # the step runs the graph on fewer samples
        check_batch_is_dynamic(captured.gm, captured.input_names, max(2, dp * microbatches))
    if pp > 1:
        check_outputs_have_batch_dim(captured.gm, captured.input_names, captured.out_spec)
    check_parameter_writes(captured.gm, dp, pp, microbatches)
    rewritten: list = []
    passes.run("eager_attention", apply_eager_attention, captured.gm, rewritten)
    passes.run("explicit_sizes", apply_explicit_sizes, captured.gm)
    if tp > 1:
        passes.run("norms_over_projections", apply_norms_over_projections, captured.gm)
    stacked: dict = {}
    unstacked: list = []
    if ep > 1:
        lists, unstacked = find_module_experts(captured.gm.graph)
        passes.run("stack_experts", apply_stack_experts, captured.gm, lists, stacked)
    groups = tied_groups(model)
    blocks = blocks_in_run_order(captured.gm.graph, find_blocks(model))
    return Analysis(model, captured, groups, alias_map(groups), blocks, name,
                    tuple(rewritten), stacked, tuple(unstacked), tuple(modes))


@dataclass(frozen=True)
class Measured:
    """Per-unit costs of the cleaned captured graph (:func:`measure`) and the partition of
    its nodes into the units (before, blocks, after) they were summed over."""
    partition: GraphPartition
    costs: PipelineCosts


def measure(analysis: Analysis, passes: PassManager) -> Measured:
    """The cleanup pass (device constants, export's metadata checks), then the FLOPs of whole
    stages (all tp ranks), parameters and cut bytes of every unit (before, blocks, after)."""
    passes.run("cleanup", apply_cleanup, analysis.gm)
    partition = GraphPartition.of(analysis.gm.graph, analysis.blocks)
    return Measured(partition, collect_costs(analysis.gm, analysis.blocks, analysis.canonical,
                                             partition))
