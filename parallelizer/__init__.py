"""parallelizer: compile an unmodified PyTorch model into tensor-, pipeline- and
data-parallel form. CLI: ``parallelize model.py spec.yaml -o OUT``; API: :mod:`parallelizer.api`."""
from .api import ParallelModule, Program, clip_grad_norm_, compile, load_spec, parallelize

__all__ = ["load_spec", "compile", "parallelize", "ParallelModule", "Program", "clip_grad_norm_"]
