"""The line an error names (frontend/model_file.py ``user_frame``): model.py's own line when
it is on the traceback, else the deepest frame of the model's code, not of the libraries it
calls. HuBERT's SpecAugment calls numpy, and the capture error named numpy's
``_shape_base_impl.py`` (a break test) instead of transformers' line calling it."""
from __future__ import annotations

import numpy as np

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
