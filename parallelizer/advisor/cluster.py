"""The cluster file: GPUs, links and, once calibrated, what was measured on them (YAML,
pydantic-validated).

    nodes: 64
    gpus_per_node: 8
    gpu: a100-80gb          # a name from GPUS, or {name, memory_gb, memory_bandwidth_gb_s, tflops: {bf16, fp16, fp32}}
    dtype: bf16             # compute dtype: which peak the step runs at
    intra_node: {bandwidth_gb_s: 300, latency_us: 3}   # per GPU, per direction (NVLink/NVSwitch)
    inter_node: {bandwidth_gb_s: 25, latency_us: 5}    # per GPU, per direction; only with nodes > 1
    efficiency: null        # matmul efficiency at large shapes; null = the GPU's published figure
    usable_memory: 0.9      # fraction of device memory a rank may plan for
    measured: ...           # written by `parallelize calibrate` (advisor/measured.py)

Bandwidths are what one GPU can send while receiving the same (the β of a ring collective,
Thakur et al. 2005); 1 GB = 1e9 bytes. ``efficiency`` is the fraction of the dense peak the
largest matmuls reach (the planner never fits it per model): by default the GPU's maximum
achievable matmul FLOPS as published (``advisor/compute.py``); smaller matmuls lose more to
tile and wave quantization. A ``measured:`` section replaces the datasheet by what the
calibration measured wherever it has a figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from ..errors import ClusterError
from .compute import MATMUL_EFFICIENCY
from .measured import Measured

_STRICT = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class GpuType:
    """Peak dense (no 2:4 sparsity) FLOP/s and memory of one GPU, from its datasheet."""
    name: str
    memory_gb: float           # 1e9 bytes, as the datasheet states it
    tflops: dict               # dtype -> dense peak TFLOP/s
    nvlink_gb_s: float         # per GPU per direction (half the datasheet's bidirectional figure)
    hbm_gb_s: float            # device memory bandwidth
    source: str


# Datasheet figures. NVIDIA lists tensor-core figures "with sparsity"; dense is half of them.
# fp32 is the non-tensor-core FP32 figure (what an fp32 matmul without TF32 gets).
GPUS: dict[str, GpuType] = {g.name: g for g in (
    GpuType("a100-40gb", 40, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 1555,
            "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 tensor 312 TFLOPS dense "
            "(624 sparse), FP32 19.5 TFLOPS, 40 GB HBM2 at 1,555 GB/s, NVLink 600 GB/s (SXM)"),
    GpuType("a100-80gb", 80, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 2039,
            "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 tensor 312 TFLOPS dense "
            "(624 sparse), FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (SXM)"),
    GpuType("h100-sxm", 80, {"bf16": 989.5, "fp16": 989.5, "fp32": 67}, 450, 3350,
            "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: BF16/FP16 tensor 1,979 TFLOPS "
            "with sparsity (989.5 dense), FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s"),
    GpuType("h200", 141, {"bf16": 989.5, "fp16": 989.5, "fp32": 67}, 450, 4800,
            "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: BF16/FP16 tensor 1,979 TFLOPS "
            "with sparsity (989.5 dense), FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s"),
    GpuType("b200", 180, {"bf16": 2250, "fp16": 2250, "fp32": 75}, 900, 8000,
            "NVIDIA HGX B200 datasheet (2024), per GPU of 8: FP16/BF16 tensor 36 PFLOPS sparse "
            "per board = 2,250 TFLOPS dense per GPU, FP32 600 TFLOPS per board = 75, "
            "1.44 TB HBM3e per board = 180 GB at 8 TB/s, NVLink 5 1.8 TB/s"),
)}

# Fraction of the dense peak the largest matmuls reach, per GPU type: the published maximum
# achievable matmul FLOPS (advisor/compute.py, MATMUL_EFFICIENCY, with its source); a GPU
# given by numbers takes DEFAULT_EFFICIENCY unless the file sets efficiency.
GPU_EFFICIENCY = dict(MATMUL_EFFICIENCY)
DEFAULT_EFFICIENCY = 0.8


class Link(BaseModel):
    model_config = _STRICT
    bandwidth_gb_s: float = Field(gt=0, description="a number > 0 (GB/s per GPU per direction)")
    latency_us: float = Field(5.0, ge=0, description="a number >= 0 (microseconds per message)")


class Tflops(BaseModel):
    model_config = _STRICT
    bf16: float = Field(gt=0, description="a number > 0 (dense peak TFLOP/s)")
    fp16: float = Field(gt=0, description="a number > 0 (dense peak TFLOP/s)")
    fp32: float = Field(gt=0, description="a number > 0 (dense peak TFLOP/s)")


class GpuSpec(BaseModel):
    model_config = _STRICT
    name: str = Field(description="a label for the GPU")
    memory_gb: float = Field(gt=0, description="a number > 0 (GB of device memory)")
    memory_bandwidth_gb_s: float = Field(gt=0, description="a number > 0 (GB/s of device memory)")
    tflops: Tflops


class Cluster(BaseModel):
    """A validated cluster. Build it with :func:`load_cluster` (or ``Cluster.model_validate``)."""
    model_config = _STRICT
    nodes: int = Field(ge=1, description="an integer >= 1 (number of nodes)")
    gpus_per_node: int = Field(ge=1, description="an integer >= 1")
    gpu: Union[str, GpuSpec] = Field(description=f"one of {', '.join(GPUS)} or a mapping "
                                     "{name, memory_gb, memory_bandwidth_gb_s, tflops: {bf16, fp16, fp32}}")
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="one of 'bf16', 'fp16', 'fp32'")
    intra_node: Optional[Link] = None   # None: the GPU's NVLink figure, 3 us
    inter_node: Optional[Link] = None   # needed only when nodes > 1
    efficiency: Optional[float] = Field(None, gt=0, le=1, description="null or a number in (0, 1]")
    measured: Optional[Measured] = None
    usable_memory: float = Field(0.9, gt=0, le=1, description="a number in (0, 1] (fraction of "
                                 "device memory a rank may plan for; the rest: CUDA context, NCCL "
                                 "buffers, allocator fragmentation)")

    @model_validator(mode="after")
    def _known_gpu(self, info: ValidationInfo) -> "Cluster":
        if isinstance(self.gpu, str) and self.gpu.lower() not in GPUS:
            raise ValueError(f"gpu: unknown GPU '{self.gpu}'; use one of {', '.join(GPUS)} or give "
                             f"{{name, memory_gb, tflops: {{bf16, fp16, fp32}}}} and intra_node")
        if (info.context or {}).get("calibrating"):  # calibrate measures the links itself
            return self
        if (not isinstance(self.gpu, str) and self.intra_node is None and self.gpus_per_node > 1
                and not self._measured("intra_node")):
            raise ValueError("intra_node: a GPU given by numbers needs intra_node "
                             "{bandwidth_gb_s, latency_us} (there is no NVLink figure to default to), "
                             "or a measured: section from `parallelize calibrate`")
        if self.nodes > 1 and self.inter_node is None and not self._measured("inter_node"):
            raise ValueError(f"inter_node is missing: a cluster of {self.nodes} nodes needs inter_node: "
                             f"{{bandwidth_gb_s: B, latency_us: L}} (the network per GPU per "
                             f"direction, e.g. {{bandwidth_gb_s: 25, latency_us: 5}} for one "
                             f"200 Gb/s NIC per GPU), or a measured: section from `parallelize "
                             f"calibrate` on {self.nodes} nodes; a one-node cluster needs none")
        return self

    def _measured(self, scope: str) -> bool:
        return self.measured is not None and bool(self.measured.collectives.get(scope))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_name(self) -> str:
        return self.gpu.lower() if isinstance(self.gpu, str) else self.gpu.name

    @property
    def memory_bytes(self) -> float:
        return (GPUS[self.gpu_name].memory_gb if isinstance(self.gpu, str) else self.gpu.memory_gb) * 1e9

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory

    @property
    def peak_flops(self) -> float:
        """Dense peak FLOP/s of one GPU in ``dtype``."""
        return self.peak_flops_for(self.dtype)

    def peak_flops_for(self, dtype: str) -> float:
        table = GPUS[self.gpu_name].tflops if isinstance(self.gpu, str) else self.gpu.tflops.model_dump()
        return table[dtype] * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        gb = GPUS[self.gpu_name].hbm_gb_s if isinstance(self.gpu, str) else self.gpu.memory_bandwidth_gb_s
        return gb * 1e9

    @property
    def matmul_efficiency(self) -> float:
        """Fraction of the dense peak the largest matmuls reach (module docstring)."""
        if self.efficiency is not None:
            return self.efficiency
        return GPU_EFFICIENCY.get(self.gpu_name, DEFAULT_EFFICIENCY)

    achieved_efficiency = matmul_efficiency

    def link(self, group: int, stride: int) -> Link:
        """The link a collective over ``group`` ranks ``stride`` apart crosses (ranks
        numbered node by node): NVLink when the group fits in one node, else the network."""
        if group <= 1 or group * stride <= self.gpus_per_node or self.inter_node is None:
            if self.intra_node is not None:
                return self.intra_node
            if isinstance(self.gpu, str):
                return Link(bandwidth_gb_s=GPUS[self.gpu_name].nvlink_gb_s, latency_us=3.0)
            return Link(bandwidth_gb_s=self.gpu.memory_bandwidth_gb_s, latency_us=3.0)
        return self.inter_node


def load_cluster(path: str | Path, calibrating: bool = False) -> Cluster:
    """Read and validate a cluster YAML file (``calibrating``: without the links that
    ``parallelize calibrate`` is about to measure).

    Raises:
        ClusterError: missing or unreadable file, bad YAML, an unknown key, a wrong type or
            out-of-range value (naming the dotted key, the value and what is allowed).
    """
    path = Path(path)
    if not path.is_file():
        raise ClusterError(f"cluster file {path} does not exist (or is not a file); pass a YAML "
                           f"file with nodes, gpus_per_node, gpu (and inter_node for several nodes; see "
                           f"specs/clusters/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ClusterError(f"cluster file {path} is not valid YAML{where}: "
                           f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {path} must be a YAML mapping, got {type(data).__name__}")
    return cluster_from_dict(data, str(path), calibrating)


def cluster_from_dict(data: dict, where: str = "cluster", calibrating: bool = False) -> Cluster:
    """Validate ``data``. Raises ClusterError naming each bad key."""
    try:
        return Cluster.model_validate(data, context={"calibrating": calibrating})
    except ValidationError as e:
        msgs = []
        for d in e.errors(include_url=False):
            key = ".".join(str(p) for p in d["loc"] if not str(p).startswith(("str", "GpuSpec")))
            if d["type"] == "extra_forbidden":
                msgs.append(f"unknown key '{key}'")
            elif d["type"] == "value_error":
                msgs.append(str(d["ctx"]["error"]))
            elif d["type"] == "missing":
                msgs.append(f"{key} is missing")
            else:
                msgs.append(f"{key} must be {_describe(d['loc'])}, got {d['input']!r}")
        raise ClusterError(f"invalid cluster {where}: " + "; ".join(dict.fromkeys(msgs))) from None


def _describe(loc) -> str:
    model = Cluster
    for part in loc:
        field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
        if field is None:
            continue
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner and part != loc[-1]:
            model = inner[0]
        else:
            return field.description or "a valid value"
    return "a valid value"
