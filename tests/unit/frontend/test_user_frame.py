"""The line an error names (frontend/model_file.py ``user_frame``): model.py's own line when
it is on the traceback, else the deepest frame of the model's code, not of the libraries it
calls. HuBERT's SpecAugment calls numpy, and the capture error named numpy's
``_shape_base_impl.py`` (a break test) instead of transformers' line calling it. Where that
line failed inside a layer (torch.nn's code, or a model library's), the layer's line follows:
BatchNorm with ``momentum=None`` is not capturable, and the error named only the model's
``x = x + block(x)``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from parallelizer.frontend.model_file import user_frame


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("no error")


def test_the_deepest_frame_outside_numpy_and_the_standard_library_is_named(tmp_path):
    lib = tmp_path / "modeling_lib.py"
    lib.write_text("import numpy as np, json\n"
                   "def mask(a):\n"
                   "    return np.put_along_axis(a, np.zeros((1, 1)), 1, -1)\n"
                   "def parse():\n"
                   "    return json.loads('{')\n")
    namespace: dict = {}
    exec(compile(lib.read_text(), str(lib), "exec"), namespace)
    e = _raised(lambda: namespace["mask"](np.zeros((2, 3))))
    assert user_frame(e, tmp_path / "model.py") == \
        f"\n  at {lib}:3: return np.put_along_axis(a, np.zeros((1, 1)), 1, -1)"
    e = _raised(namespace["parse"])
    assert user_frame(e, tmp_path / "model.py") == f"\n  at {lib}:5: return json.loads('{{')"


def test_the_layer_the_line_calls_is_named_when_it_failed_inside_it(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("import torch.nn.functional as F\n"
                     "def fwd(x):\n"
                     "    return F.interpolate(x, size=2, scale_factor=2.0)\n")
    namespace: dict = {}
    exec(compile(model.read_text(), str(model), "exec"), namespace)
    e = _raised(lambda: namespace["fwd"](torch.zeros(1, 1, 4)))
    where = user_frame(e, model)
    assert where.startswith(f"\n  at {model}:3: return F.interpolate(")
    assert "\n  inside " in where and "torch/nn/functional.py:" in where and "raise ValueError" in where


def test_batch_norm_with_momentum_none_is_refused_naming_its_line(tmp_path):
    from parallelizer.errors import CaptureError
    from parallelizer.frontend.capture import capture

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(8, momentum=None)

        def forward(self, x):
            return x + self.norm(x)

    with pytest.raises(CaptureError) as e:
        capture(Block().train(), (torch.randn(4, 8, 3),), tmp_path / "model.py")
    msg = str(e.value)
    assert "batchnorm.py:" in msg and "float(self.num_batches_tracked)" in msg, msg
    assert "momentum=None" in msg and "give it a momentum" in msg
