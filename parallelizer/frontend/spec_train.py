"""The spec's training sections (``run.py --train``): the optimizer with its clipping and
LR schedule, gradient accumulation, token data. Part of :mod:`parallelizer.frontend.spec` (same strict rules,
rendered into docs/spec.md with the rest)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

# every section of the spec: unknown keys are errors, values are not coerced, specs are frozen
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)


def doc(text: str) -> dict[str, str]:
    """``json_schema_extra`` of a field: what it does beyond its ``description``, which is
    the "what is allowed" phrase a SpecError quotes ("mesh.tp must be <description>, got 0").
    Both are rendered into docs/spec.md by :mod:`parallelizer.frontend.spec_reference`."""
    return {"doc": text}


class Schedule(BaseModel):
    model_config = STRICT
    warmup_steps: int = Field(0, ge=0, description="an integer >= 0 (optimizer steps of linear warmup)",
                              json_schema_extra=doc(
                                  "Step k < warmup_steps (0-based) runs at lr x (k + 1) / "
                                  "(warmup_steps + 1), reaching optimizer.lr at step warmup_steps "
                                  "(torch.optim.lr_scheduler.LinearLR)."))
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="one of 'constant', 'linear', 'cosine' (the decay after warmup)",
        json_schema_extra=doc("linear: LinearLR down to min_lr; cosine: CosineAnnealingLR down "
                               "to min_lr; both over decay_steps, then min_lr. Composed with the "
                               "warmup by SequentialLR; its state is saved with --save and "
                               "restored by --resume."))
    decay_steps: Optional[int] = Field(
        None, ge=1, description="null (= run.py --steps minus warmup_steps) or an integer >= 1",
        json_schema_extra=doc("Steps from the end of warmup to min_lr."))
    min_lr: float = Field(0.0, ge=0, description="a number >= 0 and <= optimizer.lr (the lr "
                          "linear / cosine decay ends at)")


class Optimizer(BaseModel):
    model_config = STRICT
    name: Literal["adamw", "sgd"] = Field("adamw", description="one of 'adamw', 'sgd'")
    lr: float = Field(1.0e-3, gt=0, description="a number > 0",
                      json_schema_extra=doc("Learning rate of run.py --train and of the --verify step."))
    weight_decay: float = Field(0.0, ge=0, description="a number >= 0")
    max_norm: Optional[float] = Field(
        None, gt=0, description="null (no clipping) or a number > 0 (clip the global gradient "
                                "2-norm to it)",
        json_schema_extra=doc(
            "The norm of all gradients of the original model, each element counted once over "
            "tp shards, pipeline stages, FSDP shards and ep ranks (tied and copied weights and "
            "expert replicas once), as "
            "torch.nn.utils.clip_grad_norm_ of the unmodified model; run.py --log-every prints "
            "it. The Python API: pm.clip_grad_norm_(max_norm)."))
    schedule: Schedule = Field(Schedule(), description="the learning-rate schedule of run.py "
                               "--train: warmup, then decay to min_lr")

    @model_validator(mode="after")
    def _min_lr(self) -> "Optimizer":
        if self.schedule.min_lr > self.lr:
            raise ValueError(f"optimizer.schedule.min_lr ({self.schedule.min_lr}) must be <= "
                             f"optimizer.lr ({self.lr}); lower min_lr or raise lr.")
        return self


class Train(BaseModel):
    model_config = STRICT
    grad_accum: int = Field(1, ge=1, description="an integer >= 1 (batches per optimizer step)",
                            json_schema_extra=doc(
                                "Each optimizer step takes grad_accum batches (of batches(), the "
                                "data section or the synthetic ones): the same loss and gradients "
                                "as one batch grad_accum times larger, in fp32 tolerance. They run "
                                "as grad_accum x pipeline.microbatches microbatches of one step, "
                                "so the data-parallel reduction runs once per optimizer step "
                                "(DDP and FSDP2 set_requires_gradient_sync(False) on the others)."))


class Data(BaseModel):
    model_config = STRICT
    path: Optional[str] = Field(
        None, description="null or a token file (.bin, .npy) or a folder of them",
        json_schema_extra=doc(
            "Token ids for run.py --train when model.py has no batches() (which takes "
            "precedence): a .bin of uint16/uint32 as nanoGPT's prepare.py writes, or a 1-D "
            ".npy; a folder: its .bin/.npy files in name order. Cut into windows of seq_len "
            "tokens, shuffled by seed each epoch; each data-parallel rank reads only its rows. "
            "The position is saved and resumed. A relative path is relative to the spec file."))
    dtype: Literal["uint16", "uint32"] = Field(
        "uint16", description="one of 'uint16', 'uint32' (element type of a .bin file)")
    seq_len: Optional[int] = Field(
        None, ge=1, description="null (= the sequence dim of example_inputs()) or an integer >= 1",
        json_schema_extra=doc("run.py --seq-len overrides it."))
    batch_size: Optional[int] = Field(
        None, ge=1, description="null (= the batch dim of example_inputs()) or an integer >= 1 "
                                "(the global batch, split over mesh.dp)",
        json_schema_extra=doc("run.py --batch-size overrides it."))
    shuffle: bool = Field(True, description="true or false (a seeded permutation of the windows "
                                            "each epoch; false: in file order)")
    eval: Optional[str] = Field(
        None, description="null or a held-out token file or folder, as data.path",
        json_schema_extra=doc("run.py --eval-every N computes the mean loss and perplexity "
                               "on its first eval_batches x train.grad_accum batches "
                               "(eval_batches steps of a train step's shape), in file order."))
    eval_batches: int = Field(8, ge=1, description="an integer >= 1 (steps of each "
                              "evaluation, each train.grad_accum batches)")
