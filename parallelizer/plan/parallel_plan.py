"""ParallelPlan: the single source of truth shared by the passes, the checkpoint writer and
the emitted program.

A plan is data: JSON-serialisable, built by planners from graph facts and the spec, read
by passes and by ``run.py``. It never holds graphs or tensors.

Mesh dims are ordered ``(pp, dp, tp)`` with tp innermost, as in Megatron-LM and torchtitan,
so tensor-parallel peers are neighbouring ranks (on one node under NCCL).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional

from .experts import Experts, experts_from_json, experts_json
from .layouts import EvenSplit, copied_heads, layout_from_json, layout_json, local_length

PLAN_VERSION = 1
MESH_DIMS = ("pp", "dp", "tp")
# model.py is imported under this one name at compile time and by run.py, so output types
# it defines (a ModelOutput subclass) get the same pytree name in both processes
MODEL_MODULE = "parallelizer_model"

# Dropout random streams (Megatron-LM's model-parallel RNG, Shoeybi et al. 2019 §3): one
# shared by the tp ranks for replicated regions, one per tp rank for sharded ones
# (planning/dropout.py picks, runtime/rng.py draws).
REPLICATED, TP_LOCAL = "replicated", "tp"

# op name -> (position, keyword) of its dropout probability
DROPOUT_OPS = {
    "aten.dropout.default": (1, "p"),
    "aten.native_dropout.default": (1, "p"),
    "aten.feature_dropout.default": (1, "p"),
    "aten.alpha_dropout.default": (1, "p"),
    "aten.feature_alpha_dropout.default": (1, "p"),
    "aten.scaled_dot_product_attention.default": (4, "dropout_p"),
    # an RNN's dropout between its layers (nn.LSTM(num_layers=2, dropout=p)), drawn inside
    # the op; the packed-sequence overloads take batch_sizes before hx
    **{f"aten.{rnn}.{o}": (pos, "dropout") for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu")
       for o, pos in (("input", 5), ("data", 6))},
}

# The other random ops (ATen's ``nondeterministic_seeded`` tag) the program draws from the
# streams too (planning/dropout.plan_random_ops, runtime/rng.py), by what their values
# depend on: "factory" (a size only: ``torch.rand(B, 1, 1)``), "template" (the shape of
# their first tensor, whose values they ignore or overwrite: ``rand_like``, ``exponential_``),
# "values" (the values of a tensor input: ``bernoulli(p)``, ``normal(mean)``). A sharded
# "template" draw can be drawn whole and sliced; a sharded "values" draw cannot.
RANDOM_OPS = {
    **dict.fromkeys(("aten.rand.default", "aten.randn.default", "aten.randint.default",
                     "aten.randint.low", "aten.randperm.default", "aten.normal.float_float"),
                    "factory"),
    **dict.fromkeys(("aten.rand_like.default", "aten.randn_like.default",
                     "aten.randint_like.default", "aten.randint_like.low_dtype",
                     "aten.uniform.default", "aten.uniform_.default", "aten.normal_.default",
                     "aten.exponential.default", "aten.exponential_.default",
                     "aten.cauchy.default", "aten.cauchy_.default", "aten.log_normal.default",
                     "aten.log_normal_.default", "aten.geometric.default",
                     "aten.geometric_.default", "aten.bernoulli_.float", "aten.bernoulli.p"),
                    "template"),
    **dict.fromkeys(("aten.bernoulli.default", "aten.bernoulli.Tensor", "aten.bernoulli_.Tensor",
                     "aten.normal.Tensor_float", "aten.normal.float_Tensor",
                     "aten.normal.Tensor_Tensor", "aten.poisson.default",
                     "aten.multinomial.default", "aten._standard_gamma.default",
                     "aten.rrelu_with_noise.default", "aten.rrelu_with_noise_.default",
                     "aten.rrelu_with_noise_functional.default"), "values"),
}


@dataclass(frozen=True)
class TensorPlan:
    """Placement of one logical tensor (parameter or buffer) under the plan.

    Attributes:
        fqn: canonical fully qualified name in the original model (``model.layers.0.mlp.up_proj.weight``).
        shape: full (unsharded) shape.
        dtype: torch dtype name without prefix (``float32``).
        tp_dim: dim sharded over the tp mesh dim (``Shard(tp_dim)``), or None for ``Replicate``.
        stages: pipeline stage indices holding this tensor (two for tied weights across stages).
        is_buffer: a buffer (not trained) rather than a parameter.
        role: ``column_parallel`` | ``row_parallel`` | ``replicate`` (informational, for the report).
        layout: how the tp pieces tile ``tp_dim`` beyond Megatron's even split (fused q|k|v,
            replicated kv heads, padded vocab): a :mod:`parallelizer.plan.layouts` class,
            None for the even split; its JSON form in plan.json (:meth:`to_dict`).
        frozen: a parameter the model does not train (``requires_grad`` False, as RoFormer's
            sinusoidal position table): the program registers it with ``requires_grad``
            False too, so it gets no gradient and no optimizer update, as in the model.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    tp_dim: Optional[int]
    stages: tuple[int, ...]
    is_buffer: bool = False
    role: str = "replicate"
    layout: Optional[EvenSplit] = None
    experts: Optional[Experts] = None  # an expert weight split over ep (plan/experts.py)
    frozen: bool = False

    def to_dict(self) -> dict:
        """The JSON-ready fields (``layout`` as its JSON form), as plan.json stores them."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["layout"] = layout_json(self.layout)
        out["experts"] = experts_json(self.experts)
        return out

    @staticmethod
    def from_dict(d: dict) -> "TensorPlan":
        """Inverse of :meth:`to_dict` (ValueError: a layout that is not one)."""
        return TensorPlan(**{**d, "shape": tuple(d["shape"]), "stages": tuple(d["stages"]),
                             "layout": layout_from_json(d.get("layout"), f"{d.get('fqn')} layout"),
                             "experts": experts_from_json(d.get("experts"), f"{d.get('fqn')} experts")})

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one tp piece: the sharded dim's length under ``layout`` (n / tp for the
        even split)."""
        if self.tp_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] = local_length(s[self.tp_dim], self.layout, tp)
        return tuple(s)

    def rank_shape(self, tp: int) -> tuple[int, ...]:
        """Shape one rank holds: the tp piece (:meth:`local_shape`, what a checkpoint file
        stores), cut to the rank's experts under ``experts``."""
        local = self.local_shape(tp)
        return local if self.experts is None else self.experts.local_shape(local)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the emitted module and what crosses its boundaries.

    Attributes:
        index: stage_index in ``[0, pp * virtual_stages)``.
        module: emitted Python module name in ``OUT/program`` (``stage0``).
        fqns: canonical FQNs of the tensors this stage holds.
        inputs: names of the stage's forward inputs (model inputs for stage 0, activations after).
        outputs: names of its outputs (activations sent on; the model's flat outputs for the last).
        blocks: FQNs of the blocks (FSDP units) inside the stage, in execution order.
        rank: the pp rank running this stage (loop or V placement,
            :func:`parallelizer.plan.schedules.stage_ranks`).
    """

    index: int
    module: str
    fqns: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    blocks: tuple[str, ...] = ()
    rank: int = 0


@dataclass(frozen=True)
class ParallelPlan:
    """The whole plan. ``mesh`` maps each of ``MESH_DIMS`` to its degree."""

    mesh: dict
    zero_stage: int
    schedule: str
    microbatches: int
    seed: int
    tensors: dict  # fqn -> TensorPlan
    aliases: dict  # alias fqn -> canonical fqn (tied weights)
    stages: tuple  # StagePlan, pp * virtual_stages of them, in pipeline order
    input_names: tuple[str, ...] = ()
    inputs_are_kwargs: bool = False
    out_spec: str = ""  # torch.utils._pytree.treespec_dumps of the model's output
    model_file: str = "model.py"
    tp_report: tuple = ()  # human-readable lines: what was sharded, what was gathered and why
    activation_checkpointing: str = "none"  # none | full | selective
    checkpoint_every: int = 1  # under selective: every k-th block, counted over the model
    checkpointed: tuple = ()  # block FQNs whose forward is recomputed in backward (planned)
    virtual_stages: int = 1  # pipeline stages per pp rank
    # FSDP2 options (zero_stage 2/3; runtime/data_parallel.py): HSDP split of dp, explicit
    # prefetch depth, CPU offload, MixedPrecisionPolicy dtypes (spec names: fp32/bf16/fp16)
    dp_replicate: int = 1
    prefetch_forward: int = 1
    prefetch_backward: int = 1
    offload: bool = False
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    # gradient compression of the dp reduction (compression.plan_settings): {"method": none |
    # fp16 | bf16 | powersgd | topk, "rank", "start_iter", "ratio", "error_feedback"}
    compression: dict = field(default_factory=lambda: {"method": "none"})
    version: int = PLAN_VERSION
    # What a checkpoint needs to be re-partitioned without the model (convert/target.py):
    # {"blocks", "block_costs", "pre_cost", "post_cost", "uses": {fqn: [cost-model unit]},
    #  "state_dict_keys": [...]} (planning/tensors.py:pipeline_structure); empty if absent.
    structure: dict = field(default_factory=dict)
    # Run-time settings run.py needs beyond placements, copied from the spec at compile time so
    # the program reads plan.json only: {"optimizer": {name, lr, weight_decay},
    # "verify": {atol, rtol, optimizer}} (frontend/spec.py documents each key).
    settings: dict = field(default_factory=dict)
    # Gradient-sync groups (:func:`grad_sync_groups`): [{"kind": "tied" | "replicated_heads" |
    # "partial_tp", "key": stage indices | kv head count | parameter FQNs, "ranks": [[global
    # ranks], ...]}]; the runtime creates each process group once, in this order, on every
    # rank (partial_tp's groups are the tp mesh dim's own).
    grad_sync: tuple = ()
    # modules run.py imports before building stages: custom-op libraries the graph calls and
    # the modules of the output pytree's types (parallelizer/analysis/needed_imports.py)
    imports: tuple[str, ...] = ()
    # flat output indices of 0-dim floating-point outputs (a loss computed in forward):
    # averaged over microbatches and dp ranks, never concatenated (parallelizer/analysis/outputs.py)
    scalar_outputs: tuple[int, ...] = ()
    # Dropouts of the program and their random streams (planning/dropout.py, runtime/rng.py):
    # {"node", "module", "op", "p", "stream": "replicated" | "tp"} each; read by --verify
    dropout: tuple = ()
    # The other random ops (planning/dropout.plan_random_ops): {"node", "module", "op",
    # "stream": "replicated", "dim": None | the tp shard dim (drawn whole, this rank's slice
    # kept), "line"} each; --verify runs them on fixed stand-ins (runtime/rng.py)
    random: tuple = ()
    # vocab_parallel logits handed to loss_fn sharded (planning/vocab.py): (flat output index,
    # vocabulary size) pairs; the last stage returns this rank's Shard(-1) columns for them
    vocab_outputs: tuple = ()
    # Expert parallelism (planning/experts.py, docs/expert-parallel.md): ranks each
    # mixture-of-experts layer's experts are split over, carved out of dp (ep divides dp);
    # one {"module", "experts", "weights", "router"} per layer found, for report.md
    ep: int = 1
    expert_layers: tuple = ()
    # (input name, dim, size) of each input's batch (dim 0) or sequence (dim 1) size the
    # captured graph holds as a constant (analysis/outputs.py fixed_sizes): run.py refuses
    # --batch-size / --seq-len / data.seq_len that differ
    fixed_sizes: tuple = ()
    # (input name, dim) of each dim 0 or 1 the captured graph holds as a number
    # (analysis/outputs.py static_dims): --seq-len / --batch-size leave those as they are
    static_dims: tuple = ()
    # (input name, dim, low, high or None, where) of each batch / sequence size the model's
    # code bounds (analysis/input_bounds.py size_ranges): run.py refuses sizes outside [low, high]
    size_ranges: tuple = ()
    # (input name, dim, example size, guard, {input name: example shape}, excluded spans) of
    # each torch.export guard on a batch / sequence size that fixes none but excludes some
    # (analysis/outputs.py size_guards: nanoGPT's T != 64): run.py refuses a size breaking it
    size_guards: tuple = ()
    # (input name, dim) of each dim past 1 the captured graph holds as the sequence length
    # (analysis/outputs.py sequence_dims: a (B, S, S) mask's dim 2): --seq-len resizes it too
    sequence_dims: tuple = ()
    # Token means divided by the whole step's count (planning/token_mean.py): {"sites": [...],
    # "counter": source of the per-chunk count, "exact": bool} (plan/decisions.py
    # TokenMeanDecision); empty when the graph has none
    token_means: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.mesh["pp"] * self.mesh["dp"] * self.mesh["tp"]

    @property
    def num_stages(self) -> int:
        """Pipeline stages, ``pp * virtual_stages``; one checkpoint file per stage and tp rank."""
        return self.mesh["pp"] * self.virtual_stages

    def local_stages(self, pp_rank: int) -> list[int]:
        """Indices of the stages pp rank ``pp_rank`` runs, in pipeline order."""
        return [st.index for st in self.stages if st.rank == pp_rank]

    def with_activation_checkpointing(self, mode: str, every: int = 1) -> "ParallelPlan":
        """This plan under another ``activation_checkpointing`` mode (same program and
        checkpoint; only which emitted blocks recompute their forward changes)."""
        # the model's blocks as planned (structure), else those the stages emit, in order
        blocks = self.structure.get("blocks") or list(dict.fromkeys(
            b for st in self.stages for b in st.blocks))
        return replace(self, activation_checkpointing=mode, checkpoint_every=every,
                       checkpointed=checkpointed_blocks(blocks, mode, every))

    def to_json(self) -> str:
        d = asdict(self)
        d["tensors"] = {k: v.to_dict() for k, v in self.tensors.items()}
        return json.dumps(d, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ParallelPlan":
        d = json.loads(text)
        tensors = {k: TensorPlan.from_dict(v) for k, v in d.pop("tensors").items()}
        stages = tuple(StagePlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
                       for s in d.pop("stages"))
        d["input_names"] = tuple(d.get("input_names", ()))
        d["tp_report"] = tuple(d.get("tp_report", ()))
        d["checkpointed"] = tuple(d.get("checkpointed", ()))
        d["grad_sync"] = tuple(d.get("grad_sync", ()))
        d["imports"] = tuple(d.get("imports", ()))
        d["scalar_outputs"] = tuple(d.get("scalar_outputs", ()))
        d["dropout"] = tuple(d.get("dropout", ()))
        d["random"] = tuple(d.get("random", ()))
        d["vocab_outputs"] = tuple(tuple(p) for p in d.get("vocab_outputs", ()))
        d["fixed_sizes"] = tuple(tuple(p) for p in d.get("fixed_sizes", ()))
        d["static_dims"] = tuple(tuple(p) for p in d.get("static_dims", ()))
        d["size_ranges"] = tuple(tuple(p) for p in d.get("size_ranges", ()))
        d["sequence_dims"] = tuple(tuple(p) for p in d.get("sequence_dims", ()))
        d["size_guards"] = tuple((*p[:5], tuple(map(tuple, p[5])))
                                 for p in d.get("size_guards", ()))
        d["expert_layers"] = tuple(d.get("expert_layers", ()))
        return ParallelPlan(tensors=tensors, stages=stages, **d)

    def hash(self) -> str:
        """sha256 of the layout-defining part of the plan (mesh and tensor placements);
        a checkpoint's manifest records it so a shard set is never read under another plan."""
        # checkpoint files hold every expert (each ep rank reads its rows of them), so ep,
        # like dp, is left out: a save at one ep degree loads at another
        layout = {"mesh": self.mesh, "tensors": {
            k: {f: x for f, x in v.to_dict().items() if f != "experts"}
            for k, v in sorted(self.tensors.items())}}
        return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


def checkpointed_blocks(blocks, mode: str, every: int) -> tuple[str, ...]:
    """Blocks whose activations are recomputed in backward (Chen et al. 2016): all under
    ``full``, every ``every``-th counted over the whole model from the first under
    ``selective`` (a block cut across stages counts once: both parts alike), none under
    ``none``."""
    if mode == "full":
        return tuple(blocks)
    if mode == "selective":
        return tuple(b for i, b in enumerate(blocks) if i % every == 0)
    return ()


def global_rank(mesh: dict, pp: int, dp: int, tp: int) -> int:
    """Global rank of mesh coordinate (pp, dp, tp): row-major over ``MESH_DIMS``, tp
    innermost (``init_device_mesh`` over ``(pp, dp, tp)``)."""
    return (pp * mesh["dp"] + dp) * mesh["tp"] + tp


def grad_sync_groups(plan: ParallelPlan, partial: Optional[tuple] = None) -> tuple[dict, ...]:
    """The rank groups whose gradients are summed after backward, beyond data parallelism:

    - ``tied``: a weight held by several stages (tied embedding and LM head) is summed over
      the pp ranks running those stages, per (dp, tp) coordinate (Megatron-LM's embedding
      group, Shoeybi et al. 2019 §3); ``key``: the stage indices.
    - ``replicated_heads``: a kv head copied to ``tp / heads`` tp ranks (tp > kv heads) is
      summed over those ranks, per (pp, dp) coordinate, since each copy sees only its rank's
      query heads; ``key``: the kv head count.
    - ``partial_tp``: replicated parameters whose gradient is Partial over tp (derived:
      planning/gradients.py; a per-head q/k norm weight applied to the rank's heads) are
      summed over the tp ranks of each (pp, dp) coordinate, once per step; ``key``: their
      canonical FQNs (``partial``; default: those of ``plan.grad_sync``'s entry).

    Placement-dependent (stage -> pp rank), so ``with_schedule`` recomputes it.
    """
    if partial is None:
        partial = next((tuple(e["key"]) for e in plan.grad_sync if e["kind"] == "partial_tp"), ())
    m = plan.mesh
    rank_of = {st.index: st.rank for st in plan.stages}
    out = []
    for stages in sorted({t.stages for t in plan.tensors.values() if len(t.stages) > 1 and not t.is_buffer}):
        pp_ranks = sorted({rank_of.get(s, s) for s in stages})
        if len(pp_ranks) > 1:
            out.append({"kind": "tied", "key": list(stages), "ranks": [
                [global_rank(m, p, d, t) for p in pp_ranks]
                for d in range(m["dp"]) for t in range(m["tp"])]})
    for k in sorted({k for t in plan.tensors.values() for k in copied_heads(t.layout)}):
        copies = m["tp"] // k
        out.append({"kind": "replicated_heads", "key": k, "ranks": [
            [global_rank(m, p, d, t) for t in range(h * copies, (h + 1) * copies)]
            for p in range(m["pp"]) for d in range(m["dp"]) for h in range(k)]})
    if partial:
        out.append({"kind": "partial_tp", "key": sorted(partial), "ranks": [
            [global_rank(m, p, d, t) for t in range(m["tp"])]
            for p in range(m["pp"]) for d in range(m["dp"])]})
    return tuple(out)

