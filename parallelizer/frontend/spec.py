"""The parallelization spec: YAML (OmegaConf) -> validated, frozen pydantic ``Spec``.

Loading is two steps, as in Hydra-style configs: OmegaConf reads the file, merges
``key=value`` overrides and resolves ``${...}`` interpolations (plus our ``${package:NAME}``
resolver); pydantic then validates the plain dict against a schema that forbids unknown
keys at every level. Every failure is a :class:`SpecError` with one short paragraph naming
the dotted key, the value seen and what is allowed. docs/spec.md, the reference of every
key, is rendered from the fields' descriptions by :mod:`parallelizer.frontend.spec_reference`.

Defaults::

    mesh: {dp: 1, tp: 1, pp: 1}
    pipeline: {microbatches: 1, schedule: 1f1b, virtual_stages: 1, split_points: null,
               layers_per_stage: null}
    zero_stage: 3
    checkpoint: {path: null}
    seed: 0
    optimizer: {name: adamw, lr: 1.0e-3, weight_decay: 0.0, max_norm: null,
                schedule: {warmup_steps: 0, decay: constant, decay_steps: null, min_lr: 0.0}}
    train: {grad_accum: 1}
    data: {path: null, dtype: uint16, seq_len: null, batch_size: null, shuffle: true,
           eval: null, eval_batches: 8}
    compile: false
    verify: {atol: 1.0e-5, rtol: 1.0e-5, optimizer: sgd}
    self_check: {mode: auto, max_params: 50000000, max_gflops: 1000, max_input_elements: null}
    activation_checkpointing: {mode: none, every: 2}
    fsdp: {prefetch: {forward: null, backward: null}, offload: false}   # null prefetch = 1
    mixed_precision: {param_dtype: fp32, reduce_dtype: null}          # null = param_dtype
    data_parallel: {compression: none, error_feedback: true,
                    powersgd: {rank: null, start_iter: null}, topk: {ratio: null}}

``mesh.dp_replicate``, ``fsdp.*`` and a non-fp32 ``mixed_precision.reduce_dtype`` need FSDP2
(zero_stage 2/3); under zero_stage 0/1 they are a SpecError rather than silently ignored.
``mixed_precision.param_dtype`` works on every layout: FSDP2's policy under zero_stage 2/3,
autocast with fp32 master weights under 0/1 (runtime/data_parallel.py).
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, Field, ValidationError, model_validator

from parallelizer.errors import SpecError
from parallelizer.frontend.spec_errors import format_errors
from parallelizer.frontend.spec_data_parallel import DataParallel, Fsdp, MixedPrecision
from parallelizer.frontend.spec_train import STRICT as _STRICT, Data, Optimizer, Train, doc as _doc
from parallelizer.plan.schedules import check as check_schedule

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _package_dir(name: str) -> str:
    """OmegaConf resolver ``${package:NAME}``: directory of the installed package NAME.

    Raises:
        ValueError: NAME is not installed or is a single-file module (OmegaConf wraps it;
            :func:`load_spec` reports it as a SpecError naming the key).
    """
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"Python package '{name}' is not installed; pip install it or fix the name")
    if not found.submodule_search_locations:
        raise ValueError(f"'{name}' is a single-file module, not a package directory")
    return str(Path(list(found.submodule_search_locations)[0]).resolve())


# OmegaConf 2.4 renamed register_new_resolver (now deprecated) to register_resolver.
_register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
_register("package", _package_dir, replace=True)


class Mesh(BaseModel):
    model_config = _STRICT
    dp: int = Field(1, ge=1, description="an integer >= 1 (data-parallel degree)")
    tp: int = Field(1, ge=1, description="an integer >= 1 (tensor-parallel degree)")
    pp: int = Field(1, ge=1, description="an integer >= 1 (pipeline-parallel degree)")
    dp_replicate: int = Field(1, ge=1, description="an integer >= 1 that divides mesh.dp (HSDP: "
                                                   "dp = dp_replicate x dp_shard)",
                              json_schema_extra=_doc(
                                  "FSDP2 on a 2-D mesh: shard within a group of dp_shard ranks, "
                                  "replicate across the dp_replicate groups; zero_stage 2/3 only."))
    ep: int = Field(1, ge=1, description="an integer >= 1 that divides mesh.dp (expert-parallel degree)",
                    json_schema_extra=_doc(
                        "Each mixture-of-experts layer's experts are split over ep of the dp "
                        "ranks (carved out of dp, as torchtitan and Megatron-LM do; no extra "
                        "processes): tokens reach their experts' ranks by all-to-all. "
                        "docs/expert-parallel.md."))


class Pipeline(BaseModel):
    model_config = _STRICT
    microbatches: int = Field(1, ge=1, description="an integer >= 1 (microbatches per step)",
                              json_schema_extra=_doc(
                                  "At mesh.pp 1 too the step splits the batch into this many "
                                  "microbatches whose gradients accumulate (the dp reduction in the "
                                  "last one only), so the batch per dp rank must be a multiple of it. "
                                  "Under 1f1b >= mesh.pp; with dualpipev >= 2 x mesh.pp; with "
                                  "interleaved_1f1b / interleaved_zero_bubble a multiple of "
                                  "max(1, microbatches // mesh.pp). `parallelize check` warns "
                                  "below 2 x mesh.pp (a bubble over a third of the step)."))
    schedule: str = Field("1f1b", description="a schedule name (see parallelizer.plan.schedules)",
                          json_schema_extra=_doc(
                              "A schedule of the installed torch.distributed.pipelining (torch "
                              "2.13 has all): gpipe, 1f1b (one stage per rank); "
                              "interleaved_1f1b, looped_bfs (virtual_stages >= 2); "
                              "interleaved_zero_bubble (any virtual_stages); zbv, dualpipev "
                              "(virtual_stages = 2, V placement). All run with every "
                              "zero_stage; `run.py --schedule` runs the same stages under "
                              "another one."))
    virtual_stages: int = Field(1, ge=1, description="an integer >= 1 (pipeline stages per pp rank)",
                                json_schema_extra=_doc(
                                    "The model is cut into mesh.pp x virtual_stages stages, stage "
                                    "s on rank s % pp (V schedules: rank r holds stages r and "
                                    "2 pp - 1 - r)."))
    split_points: Optional[list[str]] = Field(
        None, description="null or a list of block FQNs where stages 1.. begin, e.g. "
                          "['model.layers.16']",
        json_schema_extra=_doc(
            "A block ([model.layers.16]) or a direct child of one ([model.layers.16.mlp]: the "
            "block is cut, the stage begins at that child; any child of a block whose children "
            "run one after another). Replaces the FLOP-balanced split; a bad FQN is an error "
            "listing the valid ones."))
    layers_per_stage: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, description="null or a list of block counts per stage, e.g. [15, 17]; each >= 1 "
                          "but the last, which may be 0 (a stage of only the final norm and head)",
        json_schema_extra=_doc("They sum to the number of blocks; not together with "
                               "pipeline.split_points."))

    @model_validator(mode="after")
    def _one_split_override(self) -> "Pipeline":
        if self.split_points is not None and self.layers_per_stage is not None:
            raise ValueError("set pipeline.split_points or pipeline.layers_per_stage, not both "
                             f"(got {self.split_points} and {self.layers_per_stage})")
        return self


class Checkpoint(BaseModel):
    model_config = _STRICT
    path: Optional[str] = Field(
        None, description="null or a path to a Hugging Face safetensors file or folder",
        json_schema_extra=_doc(
            "The weights to start from (model.safetensors or a sharded "
            "model.safetensors.index.json). A relative path is relative to the spec file (to "
            "the current directory when given as an override)."))


class Verify(BaseModel):
    model_config = _STRICT
    atol: float = Field(1.0e-5, ge=0, description="a number >= 0 (absolute tolerance)",
                        json_schema_extra=_doc(
                            "Of run.py --verify, scaled by each tensor's magnitude "
                            "(atol * max(1, max|reference|)). Raised to the compute dtype's "
                            "under mixed_precision (bf16 3e-2, fp16 5e-3) and under fp16/bf16 "
                            "compression; --verify prints which rule it used."))
    rtol: float = Field(1.0e-5, ge=0, description="a number >= 0 (relative tolerance)",
                        json_schema_extra=_doc("Of run.py --verify, as verify.atol."))
    # SGD by default: Adam's first step is about lr * sign(g), so fp32 rounding in a
    # near-zero gradient flips whole updates; gradients are compared directly anyway.
    optimizer: Literal["sgd", "adamw"] = Field(
        "sgd", description="one of 'sgd', 'adamw' (optimizer of the --verify step; lr from optimizer.lr)",
        json_schema_extra=_doc(
            "SGD by default: Adam's first step is about lr * sign(g), which turns fp32 rounding "
            "of a near-zero gradient into a full-size update difference; gradients are "
            "compared directly."))


class Capture(BaseModel):
    model_config = _STRICT
    data_dependent_branches: Literal["refuse", "as_example"] = Field(
        "refuse", description="'refuse' or 'as_example' (a Python branch on a tensor's values in "
                              "forward, as ESM-2's `if not padding_mask.any()`: refuse the "
                              "model naming the line, or capture the branch the example batch "
                              "takes)",
        json_schema_extra=_doc(
            "as_example captures with torch.export.draft_export, which decides such a branch "
            "by the example's values and keeps the condition in the graph as an assertion. "
            "The compile warns naming each line and the branch taken; a step whose batch (or "
            "the model's own state: a counter it keeps) takes the other branch stops with an "
            "error naming that line. Give an example that takes the branch your data takes "
            "(padding in it, for a padding test)."))


class TensorParallel(BaseModel):
    model_config = _STRICT
    allow_replicated: bool = Field(
        False, description="true or false (at mesh.tp > 1, run even when no weight matrix "
                           "could be sharded, instead of failing the compile)",
        json_schema_extra=_doc("A warning instead of the error naming the op that stopped it, "
                               "or the size tp does not divide."))
    vocab_parallel: Literal["auto", True, False] = Field(
        "auto", description="'auto', true or false (shard the vocabulary embedding and LM head "
                            "over tp, Megatron-LM §3: 'auto' whenever tp > 1 and the graph "
                            "allows, report.md says why not; true: an error naming the blocker "
                            "when it cannot apply; false: keep them replicated)",
        json_schema_extra=_doc(
            "A vocabulary tp does not divide is padded. Logits returned by the model reach "
            "loss_fn as a DTensor Shard(-1) under loss_parallel; an in-graph cross-entropy is "
            "computed on the shards (docs/tensor-parallel.md)."))
    sequence_parallel: Literal["auto", True, False] = Field(
        "auto", description="one of 'auto', true, false (sequence parallelism, Korthikanti et "
                            "al. 2022 §4.2.2: norms, dropout and residual adds between the "
                            "tensor-parallel regions run on 1/tp of the sequence; auto: on "
                            "whenever mesh.tp > 1 and the graph allows, report.md says why "
                            "not; true: a compile error naming the blocker when it cannot "
                            "apply)",
        json_schema_extra=_doc("The sequence length must then be a multiple of mesh.tp at run "
                               "time (a clear error otherwise)."))

    @property
    def sequence_parallel_mode(self) -> str:
        """"auto", "true" or "false"."""
        v = self.sequence_parallel
        return v if isinstance(v, str) else ("true" if v else "false")


class SelfCheck(BaseModel):
    model_config = _STRICT
    mode: Literal["auto", True, False] = Field(
        "auto", description="'auto', true or false (the compile's numerics self-check: every tp "
                            "rank of the program run in one process on the example batch and "
                            "compared with the unmodified model, outputs and every gradient, "
                            "before OUT/ is written; auto: when mesh.tp > 1 or mesh.pp > 1 and the model and "
                            "batch are within the bounds below; true: always (parallelize "
                            "--self-check); false: never (--no-self-check))",
        json_schema_extra=_doc(
            "A difference is a compile error naming the first tensor that differs, a bug in "
            "parallelizer (docs/tensor-parallel.md). It needs the weights in fp32 and "
            "mesh.ep = 1: under auto it is skipped otherwise (a note says why), under true that "
            "is an error."))
    max_params: int = Field(
        50_000_000, ge=0, description="an integer >= 0 (auto runs the self-check only for "
                                      "models of at most this many parameters)",
        json_schema_extra=_doc("The check costs about one fp32 forward and backward of the "
                               "model on the CPU, and of each tp rank's share."))
    max_gflops: float = Field(
        1000.0, ge=0, description="a number >= 0 (auto runs the self-check only when one "
                                  "training step of the example batch costs at most this many "
                                  "GFLOPs: forward + backward, by torch.utils.flop_counter, as "
                                  "the pipeline planner counts them)",
        json_schema_extra=_doc("1000 GFLOPs is about a 50M-parameter model on 3,000 tokens; "
                               "an image or audio batch of a small model costs a fraction of "
                               "one GFLOP, whatever its element count."))
    max_input_elements: Optional[int] = Field(
        None, ge=0, description="null or an integer >= 0 (auto runs the self-check only when "
                                "the example batch's largest input has at most this many "
                                "elements; null: no bound beyond max_gflops)")


class ActivationCheckpointing(BaseModel):
    model_config = _STRICT
    mode: Literal["none", "full", "selective"] = Field(
        "none", description="one of 'none', 'full' (every block), 'selective' (every k-th block)")
    every: int = Field(2, ge=1, description="an integer >= 1 (k of 'selective')",
                       json_schema_extra=_doc("Blocks are the model's repeated blocks, as for "
                                              "pipeline stages and FSDP units."))


class Spec(BaseModel):
    """A validated, immutable spec. Build it with :func:`load_spec`."""

    model_config = _STRICT
    mesh: Mesh = Field(Mesh(), description="the device mesh: data-, tensor- and pipeline-parallel "
                       "degrees; the world size is dp x tp x pp (torchrun --nproc-per-node)")
    pipeline: Pipeline = Field(Pipeline(), description="pipeline parallelism: microbatches, schedule "
                               "and where the stages are cut (docs/pipeline.md)")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        3, description="one of 0 (DDP), 1 (DDP + ZeroRedundancyOptimizer), 2 (FSDP2, "
                       "parameters kept after forward), 3 (FSDP2, resharded after forward)",
        json_schema_extra=_doc("ZeRO stages of Rajbhandari et al. 2020 (docs/data-parallel.md)."))
    checkpoint: Checkpoint = Field(Checkpoint(), description="the weights the compile starts from "
                                   "(default: build_model()'s own)")
    seed: int = Field(0, ge=0, description="an integer >= 0",
                      json_schema_extra=_doc(
                          "Seeds the model's build and the dropout streams: a one-rank program "
                          "draws the masks of the eager model after torch.manual_seed(seed)."))
    optimizer: Optimizer = Field(Optimizer(), description="the optimizer of run.py --train")
    verify: Verify = Field(Verify(), description="the step of run.py --verify and its tolerances "
                           "(docs/run.md)")
    activation_checkpointing: ActivationCheckpointing = Field(
        ActivationCheckpointing(), description="recompute blocks in backward instead of keeping "
                                               "their activations (docs/memory.md)")
    fsdp: Fsdp = Field(Fsdp(), description="FSDP2 options, zero_stage 2/3 only (docs/data-parallel.md)")
    mixed_precision: MixedPrecision = Field(
        MixedPrecision(), description="the compute dtype (every layout) and FSDP2's reduce dtype")
    tensor_parallel: TensorParallel = Field(
        TensorParallel(), description="options of tensor parallelism (mesh.tp > 1): the "
                                      "vocabulary, the sequence, a model nothing of which shards "
                                      "(docs/tensor-parallel.md)")
    capture: Capture = Field(Capture(), description="how the model is captured (torch.export)")
    self_check: SelfCheck = Field(
        SelfCheck(), description="the compile's numerics self-check of the program against the "
                                 "model (docs/tensor-parallel.md)")
    data_parallel: DataParallel = Field(
        DataParallel(), description="gradient compression of the data-parallel reduction "
                                    "(docs/data-parallel.md)")
    train: Train = Field(Train(), description="run.py --train: gradient accumulation (docs/run.md)")
    data: Data = Field(Data(), description="token data for run.py --train and --eval-every "
                       "(docs/run.md#data)")
    compile: bool = Field(False, description="true or false (torch.compile each emitted block)",
                          json_schema_extra=_doc(
                              "As torchtitan: every block (FSDP / activation-checkpointing unit) "
                              "of every stage is compiled in place (nn.Module.compile, inductor), "
                              "so parameter names stay the original ones; the first step "
                              "compiles (seconds to minutes). --verify compares the compiled "
                              "program too."))

    @model_validator(mode="after")
    def _check_compression(self) -> "Spec":
        from parallelizer.plan.compression import check_compression  # pure checks, kept beside the hooks' docs
        problem = check_compression(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_data_parallel(self) -> "Spec":
        """Combinations that need FSDP2 (zero_stage 2/3), and the HSDP split."""
        dp, rep, z = self.mesh.dp, self.mesh.dp_replicate, self.zero_stage
        if dp % rep:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(f"mesh.dp_replicate ({rep}) must divide mesh.dp ({dp}): HSDP splits "
                             f"dp into dp_replicate x dp_shard; valid choices: {divisors}.")
        ep = self.mesh.ep
        if dp % ep:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(f"mesh.ep ({ep}) must divide mesh.dp ({dp}): expert parallelism splits "
                             f"the experts over ep of the data-parallel ranks (each keeps its own "
                             f"tokens); set mesh.dp to a multiple of {ep} (e.g. mesh.dp={ep}), or "
                             f"mesh.ep in {divisors}.")
        if z in (0, 1):
            mp = self.mixed_precision
            needs = [("mesh.dp_replicate", rep, rep != 1),
                     ("fsdp.offload", "true", self.fsdp.offload),
                     ("fsdp.prefetch.forward", self.fsdp.prefetch.forward, self.fsdp.prefetch.forward is not None),
                     ("fsdp.prefetch.backward", self.fsdp.prefetch.backward, self.fsdp.prefetch.backward is not None),
                     ("mixed_precision.reduce_dtype", mp.reduce_dtype, mp.reduce_dtype not in (None, "fp32"))]
            for key, value, bad in needs:
                if bad:
                    also = (" (for low-precision gradient all-reduces under DDP use "
                            "data_parallel.compression: bf16 or fp16)" if "reduce" in key else "")
                    raise ValueError(
                        f"{key}={value} needs FSDP2, i.e. zero_stage 2 or 3, but zero_stage is {z} "
                        f"(DDP{' + ZeroRedundancyOptimizer' if z == 1 else ''}, which has no such "
                        f"policy); set zero_stage=2 or zero_stage=3, or remove {key}{also}.")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> "Spec":
        # the installed torch's schedule classes check these only when built on the cluster
        p = self.pipeline
        problem = check_schedule(p.schedule, self.mesh.pp, p.virtual_stages, p.microbatches)
        if problem:
            raise ValueError(problem)
        n = self.train.grad_accum
        problem = n > 1 and check_schedule(p.schedule, self.mesh.pp, p.virtual_stages, p.microbatches * n)
        if problem:
            raise ValueError(f"train.grad_accum ({n}) runs {p.microbatches * n} microbatches "
                             f"(pipeline.microbatches x grad_accum) per step, which the schedule "
                             f"refuses: {problem}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict of every key, defaults included."""
        return self.model_dump(mode="json")


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> Spec:
    """Load a spec YAML, apply ``key=value`` overrides, resolve and validate it.

    Overrides are merged after the file (``mesh.tp=2``; values parse as YAML). A relative
    ``checkpoint.path`` is resolved against the spec file's directory, or against the
    current directory when the path itself came from an override.

    Raises:
        SpecError: missing/unreadable file, YAML syntax error, malformed override,
            interpolation failure, unknown key, wrong type or out-of-range value.
    """
    if isinstance(overrides, str):
        raise SpecError(f"overrides must be a list of 'KEY=VALUE' strings, got the string "
                        f"{overrides!r}; pass [{overrides!r}]")
    path = Path(path)
    cfg = _load_yaml(path)
    for item in overrides:
        try:
            cfg = OmegaConf.merge(cfg, _parse_override(item))
        except OmegaConfBaseException as e:
            raise SpecError(f"cannot apply override '{item}': {_omegaconf_msg(e)}") from None
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise SpecError(f"{key}: cannot resolve the value in {path}: {_omegaconf_msg(e)}") from None
    overridden = {o.split("=", 1)[0].strip() for o in overrides}
    _resolve_paths(data, lambda key: Path.cwd() if key in overridden else path.resolve().parent)
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        sources = {o.split("=", 1)[0].strip(): o for o in overrides}
        raise SpecError(f"invalid spec {path}: " + format_errors(e, sources, Spec)) from None


def _load_yaml(path: Path) -> DictConfig:
    """Read ``path`` with OmegaConf. Raises SpecError: missing file, bad YAML, not a mapping."""
    if not path.is_file():
        raise SpecError(f"spec file {path} does not exist (or is not a file); pass the path to a YAML spec")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"spec file {path} is not valid YAML{where}: {problem}") from None
    except (OSError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read spec file {path}: {_omegaconf_msg(e)}") from None
    if not isinstance(cfg, DictConfig):
        raise SpecError(f"spec file {path} must be a YAML mapping (key: value), got a list")
    return cfg


def _parse_override(item: str) -> DictConfig:
    """Parse one ``dotted.key=value`` override. Raises SpecError naming the override."""
    key, eq, _ = item.partition("=")
    if not eq or not _OVERRIDE_KEY.match(key.strip()):
        raise SpecError(f"malformed override '{item}': expected KEY=VALUE with a dotted key, "
                        f"e.g. mesh.tp=2")
    try:
        return OmegaConf.from_dotlist([item])
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise SpecError(f"malformed override '{item}': {_omegaconf_msg(e)}") from None


PATH_KEYS = (("checkpoint", "path"), ("data", "path"), ("data", "eval"))


def _resolve_paths(data: Any, base_of) -> None:
    """Make each relative string path of ``PATH_KEYS`` absolute against ``base_of(dotted
    key)`` (in place)."""
    for section, key in PATH_KEYS:
        sec = data.get(section) if isinstance(data, dict) else None
        if isinstance(sec, dict) and isinstance(sec.get(key), str) and sec[key]:
            p = Path(sec[key]).expanduser()
            sec[key] = os.path.normpath(p if p.is_absolute() else base_of(f"{section}.{key}") / p)


def _omegaconf_msg(e: BaseException) -> str:
    """First line of an OmegaConf/YAML error (drops its full_key/object_type dump)."""
    msg = str(getattr(e, "msg", None) or str(e) or type(e).__name__).strip().splitlines()[0]
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", msg)
