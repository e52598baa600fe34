"""Program: everything a compile produces, in memory, and its atomic save to OUT/."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from ..checkpoint.format import save_tensors
from ..checkpoint.publish import temp_sibling
from ..checkpoint.writer import write_checkpoint
from ..errors import UserError
from ..frontend.model_sources import MODEL_DEPS, local_modules
from ..plan.parallel_plan import MODEL_MODULE, ParallelPlan
from .plots import write_pipeline_plots


@dataclass
class Program:
    plan: ParallelPlan
    sources: dict            # relative path -> Python source (program/stage0.py, run.py)
    report: str
    model_file: Optional[Path]  # copied to OUT/model.py (its own imports to OUT/model_deps/)
    spec: dict
    state: Optional[dict] = None      # canonical fqn -> full tensor (None under --no-weights)
    reference: Optional[dict] = None  # see parallelizer.emit.reference
    warnings: list = field(default_factory=list)  # one line each, also in report.md
    pipeline: Optional[dict] = None   # planning.pipeline_summary.summarize: stage costs, bubble
    notes: list = field(default_factory=list)  # printed by the CLI (the tp summary line)

    def save(self, out_dir: Path) -> Path:
        """Write OUT/ atomically: into a temporary sibling folder, then rename.

        An existing OUT/ is replaced only when it holds a previous parallelizer output
        (a plan.json); anything else is refused, so no user folder is ever overwritten.

        Raises:
            UserError: OUT exists and is not a parallelizer output folder.
        """
        out_dir = Path(out_dir)
        check_replaceable(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(out_dir)
        try:
            self._write(tmp)
            _replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir

    def _write(self, tmp: Path) -> None:
        for rel, text in self.sources.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if rel.endswith(".sh"):
                path.chmod(0o755)
        (tmp / "plan.json").write_text(self.plan.to_json())
        (tmp / "report.md").write_text(self.report)
        if self.pipeline is not None:
            (tmp / "pipeline.json").write_text(json.dumps(self.pipeline, indent=1) + "\n")
            write_pipeline_plots(self.pipeline, tmp)
        (tmp / "spec.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(self.spec)))
        if self.model_file is not None:
            shutil.copyfile(self.model_file, tmp / "model.py")
            for rel, src in local_modules(self.model_file, MODEL_MODULE).items():
                (tmp / MODEL_DEPS / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp / MODEL_DEPS / rel)
        if self.state is not None:
            write_checkpoint(self.state, self.plan, tmp / "checkpoint")
        if self.reference is not None:
            save_tensors(_unshared(self.reference), tmp / "reference.safetensors")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no storage in common, as safetensors requires: a ``loss_fn``
    returning an output (``outputs.loss``) or ``labels`` that are ``input_ids`` share one."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


# written into OUT by run.py itself (--train: its default --log-dir, runtime/main.py)
RUN_WRITTEN = {"logs"}

EMITTED = {"run.py", "launch.sh", "launch.sbatch", "program", "checkpoint", "plan.json", "report.md", "spec.yaml", "model.py",
           "reference.safetensors", "__pycache__", MODEL_DEPS, "pipeline.json", "pipeline_costs.png",
           "pipeline_schedule.png"}


def check_replaceable(out_dir: Path) -> None:
    """OUT may be replaced only when it holds nothing but a previous compile's output.

    Raises:
        UserError: OUT is a file, or holds anything else (e.g. a checkpoint saved there).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} is a file; pass a folder to -o")
    if not out_dir.exists():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in EMITTED)
    if foreign and set(foreign) <= RUN_WRITTEN and (out_dir / "plan.json").exists():
        raise UserError(f"output folder {out_dir} holds {', '.join(f + '/' for f in foreign)} "
                        f"that run.py wrote there (--train's metrics, loss curve, TensorBoard "
                        f"events); compiling again replaces OUT whole, so move "
                        f"{'them' if len(foreign) > 1 else 'it'} away first, or choose another -o")
    if foreign or (any(out_dir.iterdir()) and not (out_dir / "plan.json").exists()):
        raise UserError(f"output folder {out_dir} holds files parallelizer did not write "
                        f"({', '.join(foreign[:5]) or 'no plan.json'}); it would be replaced whole, "
                        f"so choose another -o or move them away")


def _replace(tmp: Path, out_dir: Path) -> None:
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
