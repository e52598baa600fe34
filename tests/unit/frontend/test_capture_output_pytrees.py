"""The capture's refusal of a model no export route takes, when the model returns a pytree
node registered without key paths (diffusers registers its ``BaseOutput`` types so:
Lumina2, zoo 19 Y6). Naming the refusal ran the model once more and flattened its output
with key paths, which raised ``ValueError: Did not find a flatten_with_keys_fn``: a raw
traceback, exit 1, the real reason (a branch on a tensor's values) hidden. The output is now
flattened without key paths there (frontend/capture.py ``_eager_run``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from parallelizer.errors import CaptureError
from parallelizer.frontend.capture import capture


@dataclass
class _Output:  # a pytree node without flatten_with_keys_fn, as diffusers' BaseOutput
    sample: torch.Tensor


pytree.register_pytree_node(_Output, lambda o: ([o.sample], None),
                            lambda leaves, _: _Output(*leaves))


class _Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:  # a branch on the values: no export route captures it
            x = x * 2
        return _Output(sample=x)


def test_the_refusal_of_a_model_returning_a_pytree_without_key_paths_names_the_branch():
    with pytest.raises(CaptureError,
                       match=r"torch\.export could not capture .*\n  at .*"
                             r"test_capture_output_pytrees\.py:\d+: if x\.sum\(\) > 0"):
        capture(_Branching(), (torch.randn(2, 4, 8),), Path("model.py"))
