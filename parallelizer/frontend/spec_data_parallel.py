"""The spec's data-parallel sections: FSDP2's prefetch and offload, mixed precision, and
gradient compression of the data-parallel reduction. Part of
:mod:`parallelizer.frontend.spec` (same strict rules, rendered into docs/spec.md with the
rest; the checks across sections stay on ``Spec``)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

from parallelizer.frontend.spec_train import STRICT as _STRICT, doc as _doc


class Prefetch(BaseModel):
    model_config = _STRICT
    # None = the default (1); kept distinct so that setting it under zero_stage 0/1 is an error
    forward: Optional[int] = Field(None, ge=0, description="null or an integer >= 0 (FSDP units "
                                   "all-gathered ahead in forward; default 1)",
                                   json_schema_extra=_doc(
                                       "FSDP2 set_modules_to_forward_prefetch, per pipeline "
                                       "stage; zero_stage 2/3 only."))
    backward: Optional[int] = Field(None, ge=0, description="null or an integer >= 0 (FSDP units "
                                    "all-gathered ahead in backward; default 1)",
                                    json_schema_extra=_doc(
                                        "FSDP2 set_modules_to_backward_prefetch, per pipeline "
                                        "stage; zero_stage 2/3 only."))


class Fsdp(BaseModel):
    model_config = _STRICT
    prefetch: Prefetch = Field(Prefetch(), description="FSDP units all-gathered ahead of their use")
    offload: bool = Field(False, description="true or false (FSDP2 CPUOffloadPolicy: sharded "
                                             "parameters, gradients and optimizer state on the CPU)",
                        json_schema_extra=_doc("zero_stage 2/3 only."))


class MixedPrecision(BaseModel):
    model_config = _STRICT
    param_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="one of 'fp32', 'bf16', 'fp16' (dtype of the gathered parameters "
                            "in forward and backward)",
        json_schema_extra=_doc(
            "zero_stage 2/3: FSDP2 MixedPrecisionPolicy, the sharded fp32 parameters stay the "
            "master copy. zero_stage 0/1 and tp/pp-only layouts: the stages run under "
            "torch.autocast(param_dtype) with fp32 parameters, gradients and optimizer state. "
            "Both autocast the forward; fp16 adds a dynamic loss scale (run.py --train). A "
            "fill value the fp32 capture took as fp32's extreme (`masked_fill(~mask, "
            "torch.finfo(x.dtype).min)`) is the dtype's own extreme, as under autocast "
            "(passes/fill_precision.py). "
            "--verify compares with the fp32 model at the dtype's tolerances."))
    reduce_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        None, description="null (= param_dtype) or one of 'fp32', 'bf16', 'fp16' (dtype of the "
                          "gradient reduce-scatter / all-reduce)",
        json_schema_extra=_doc("FSDP2 only (zero_stage 2/3); under DDP the gradients are fp32 "
                               "and data_parallel.compression sets the all-reduce dtype."))


class PowerSgd(BaseModel):
    model_config = _STRICT
    # None = the default (1 / 10); kept distinct so that setting it for another method is an error
    rank: Optional[int] = Field(None, ge=1, description="null (= 1) or an integer >= 1 (rank r of "
                                "the low-rank approximation P Q^T of each gradient matrix)",
                       json_schema_extra=_doc("Only with data_parallel.compression: powersgd."))
    start_iter: Optional[int] = Field(
        None, ge=2, description="null (= 10) or an integer >= 2 (steps reduced uncompressed "
                                "before PowerSGD starts; torch's powerSGD_hook needs >= 2)",
        json_schema_extra=_doc("Only with data_parallel.compression: powersgd."))


class TopK(BaseModel):
    model_config = _STRICT
    ratio: Optional[float] = Field(None, gt=0, le=1, description="null (= 0.01) or a number in "
                                   "(0, 1] (fraction of each gradient tensor's entries sent)",
                                   json_schema_extra=_doc("Only with data_parallel.compression: topk."))


class DataParallel(BaseModel):
    model_config = _STRICT
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = Field(
        "none", description="one of 'none', 'fp16', 'bf16', 'powersgd', 'topk' (gradient "
                            "compression of the data-parallel reduction)",
        json_schema_extra=_doc("Needs mesh.dp > 1; powersgd / topk at zero_stage 2/3 need "
                               "mesh.dp_replicate > 1 and fp32 mixed_precision "
                               "(docs/data-parallel.md)."))
    error_feedback: bool = Field(True, description="true or false (powersgd/topk: add what "
                                 "compression dropped to the next step's gradient)",
                                 json_schema_extra=_doc("false only with powersgd or topk."))
    powersgd: PowerSgd = Field(PowerSgd(), description="settings of data_parallel.compression: powersgd "
                               "(Vogels et al. 2019)")
    topk: TopK = Field(TopK(), description="settings of data_parallel.compression: topk (Stich et al. "
                       "2018, Lin et al. 2018)")
