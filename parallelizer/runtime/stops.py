"""Errors every rank raises at the same point of a collective run (a non-finite step, a
failed save): one rank reports it (``rank``), the others exit with the same status quietly,
and all shut the process group down cleanly (runtime/main.py)."""
from __future__ import annotations

from ..errors import UserError


class RunStopped(UserError):
    """Raised on every rank alike; ``rank`` prints the message, ``code`` is the exit status."""

    code = 2

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


class TrainingStopped(RunStopped):
    """A non-finite loss or gradient: the run stops at that step (exit status 3)."""

    code = 3


class SaveFailed(RunStopped):
    """A save whose files could not be written: nothing was published (exit status 4)."""

    code = 4
