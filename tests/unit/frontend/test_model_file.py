"""The model.py contract (frontend/model_file.py): load_model_file, build_model,
example_batch; every error names the file, the line and the fix.
"""
import textwrap
from pathlib import Path

import pytest

from parallelizer.errors import ModelFileError, UserError
from parallelizer.frontend.model_file import build_model, example_batch, load_model_file


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source).lstrip("\n"))
    return path


CONTRACT_OK = """
import torch
from torch import nn

def build_model():
    return nn.Linear(8, 8)

def example_inputs():
    return {batch}
"""


# --- load_model_file -------------------------------------------------------------------------

def test_missing_model_file(tmp_path):
    path = tmp_path / "nope.py"
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert f"model file {path} does not exist" in msg
    assert "build_model and example_inputs" in msg
    assert isinstance(e.value, UserError)


def test_import_error_points_at_the_line(tmp_path):
    path = write(tmp_path, """
        import torch

        SCALE = 1.0
        import not_a_module_parallelizer_test
    """)
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert msg.startswith(f"importing {path} failed: ModuleNotFoundError")
    assert "not_a_module_parallelizer_test" in msg
    assert f"{path}:4: import not_a_module_parallelizer_test" in msg


def test_runtime_error_at_import_points_at_the_line(tmp_path):
    path = write(tmp_path, """
        import torch

        def helper():
            return 1 / 0

        VALUE = helper()
    """)
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert "ZeroDivisionError" in msg
    # the deepest frame in model.py: inside helper(), not the module-level call
    assert f"{path}:4: return 1 / 0" in msg


def test_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, """
        import torch

        def build_model(:
            pass
    """)
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert f"importing {path} failed: SyntaxError" in msg and "line 3" in msg


@pytest.mark.parametrize("source, missing", [
    ("def build_model():\n    pass\n", ["example_inputs()"]),
    ("def example_inputs():\n    pass\n", ["build_model()"]),
    ("build_model = 3\n", ["build_model()", "example_inputs()"]),
])
def test_missing_contract_functions(tmp_path, source, missing):
    path = write(tmp_path, source)
    with pytest.raises(ModelFileError) as e:
        load_model_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path} must define {', '.join(missing)};")
    assert "build_model() -> nn.Module" in msg and "example_inputs() ->" in msg


# --- build_model -----------------------------------------------------------------------------

@pytest.mark.parametrize("on_meta", [False, True])
def test_build_model_raising_points_at_the_line(tmp_path, on_meta):
    path = write(tmp_path, """
        def build_model():
            raise ValueError("hidden size must be even")

        def example_inputs():
            return ()
    """)
    module = load_model_file(path)
    with pytest.raises(ModelFileError) as e:
        build_model(module, on_meta=on_meta)
    msg = str(e.value)
    assert f"build_model() in {path.resolve()} raised ValueError: hidden size must be even" in msg
    assert f"{path.resolve()}:2: raise ValueError" in msg


def test_build_model_returning_no_module(tmp_path):
    path = write(tmp_path, "def build_model():\n    return 3\n\ndef example_inputs():\n    return ()\n")
    with pytest.raises(ModelFileError, match=r"returned int, expected a torch.nn.Module"):
        build_model(load_model_file(path), on_meta=False)


def test_build_model_on_meta_uses_no_memory(tmp_path):
    path = write(tmp_path, CONTRACT_OK.format(batch="()"))
    model = build_model(load_model_file(path), on_meta=True)
    assert all(p.is_meta for p in model.parameters())


# --- example_batch ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch, words", [
    ("[1, 2, 3]", ["must hold tensors with a batch dim (dim 0)", "item 0 is int 1"]),
    ("(torch.tensor(3.0),)", ["must hold tensors with a batch dim (dim 0)", "item 0 is Tensor ()"]),
    ("{'x': torch.tensor(1)}", ["must hold tensors with a batch dim (dim 0)", "key 'x' is Tensor ()"]),
    ("(torch.zeros(2, 8), 'mask')", ["must hold tensors with a batch dim (dim 0)", "item 1 is str 'mask'"]),
    # a config flag among the inputs (a break test: 'got bool', naming no key)
    ("{'input_ids': torch.zeros(2, 8), 'use_cache': False}",
     ["key 'use_cache' is bool False; a setting such as use_cache belongs in build_model's config"]),
    # forward taking one dict (a break test: the dict's token ids printed whole, no fix)
    ("({'tokens': torch.zeros(2, 8, dtype=torch.long), 'mask': torch.ones(2, 8)},)",
     ["item 0 is dict {'tokens': Tensor (2, 8) int64, 'mask': Tensor (2, 8) float32}",
      "return that dict itself from example_inputs()", "or wrap a forward that takes one dict"]),
    ("5", ["returned int; return a tuple or a dict of tensors"]),
    ("'tokens'", ["returned str; return a tuple or a dict of tensors"]),
])
def test_example_batch_errors(tmp_path, batch, words):
    path = write(tmp_path, CONTRACT_OK.format(batch=batch))
    module = load_model_file(path)
    with pytest.raises(ModelFileError) as e:
        example_batch(module)
    msg = str(e.value)
    assert msg.startswith(f"example_inputs() in {path.resolve()}")
    assert all(w in msg for w in words), msg
    assert "tensor([" not in msg, msg  # values are described by shape, never printed


@pytest.mark.parametrize("batch, expected_type", [
    ("torch.zeros(2, 8)", tuple),
    ("[torch.zeros(2, 8), torch.zeros(2, 8)]", tuple),
    ("(torch.zeros(2, 8),)", tuple),
    ("{'x': torch.zeros(2, 8)}", dict),
])
def test_example_batch_accepts_tensor_list_tuple_dict(tmp_path, batch, expected_type):
    path = write(tmp_path, CONTRACT_OK.format(batch=batch))
    out = example_batch(load_model_file(path))
    assert isinstance(out, expected_type)


def test_example_inputs_raising_is_a_model_file_error(tmp_path):
    path = write(tmp_path, """
        def build_model():
            return None

        def example_inputs():
            return 1 / 0
    """)
    with pytest.raises(ModelFileError) as e:
        example_batch(load_model_file(path))
    assert f"{path.resolve()}:5" in str(e.value)
