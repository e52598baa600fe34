"""Capture leaves the model's module-level caches as a real run fills them.
yet-another-retnet builds its decay gammas with ``@lru_cache(maxsize=1)`` on (num_heads,
device, dtype); torch.export calls it on fake tensors and the cache kept the FakeTensor, so
every later run of the unmodified model returned FakeTensors and the self-check died in a
raw traceback (zoo 18 Z9). The caches of the modules defining the model's classes are now
emptied before and after each export: the model runs as before and compiles at tp2 with the
self-check."""
import functools
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from parallelizer import compiler
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec


@functools.lru_cache(maxsize=1)
def _decay(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(0.5, 0.9, n, dtype=dtype)


class _Decayed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * _decay(16, x.dtype))


def test_a_cached_tensor_builder_is_not_left_fake():
    torch.manual_seed(0)
    model, x = nn.Sequential(_Decayed(), _Decayed()), torch.randn(2, 5, 8)
    capture(model, (x,), Path(__file__))
    out = model(x)
    assert not isinstance(out, FakeTensor) and not isinstance(_decay(16, x.dtype), FakeTensor)


def test_a_model_with_a_cached_tensor_builder_compiles():
    torch.manual_seed(0)
    program = compiler.compile_module(nn.Sequential(_Decayed(), _Decayed()), (torch.randn(2, 5, 8),),
                                      Spec.model_validate({"mesh": {"tp": 2}}), reference=False)
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes
