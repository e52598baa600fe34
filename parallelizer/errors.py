"""User-facing errors. Each names what is wrong (spec key, module FQN or file), the values
seen and the fix; the CLI prints the message alone and exits with code 2."""


class UserError(Exception):
    """Base of every error caused by user input rather than by a bug in parallelizer."""


class SpecError(UserError):
    """The spec (YAML plus overrides) is invalid: names the dotted key and what is allowed."""


class ModelFileError(UserError):
    """model.py does not follow the contract (build_model, example_inputs, ...)."""


class CaptureError(UserError):
    """torch.export (and the symbolic_trace fallback) could not capture the model."""


class PlanError(UserError):
    """The spec cannot be applied to this model (e.g. tp does not divide the heads)."""


class CheckpointError(UserError):
    """A checkpoint file is missing, corrupt, or does not match the plan or model."""


class BatchError(UserError, ValueError):
    """A batch given to the program does not fit the plan (e.g. not divisible into microbatches)."""


class ClusterError(UserError):
    """The cluster file is invalid: names the key, the value seen and what is allowed."""
