"""Front end: the model.py contract (load_model_file, build_model, example_batch) and capture.

Every user-facing error is asserted by its message: what is wrong, where (file and line),
and the fix. Capture success is checked numerically against eager at another batch size and
sequence length (the dynamic dims the emitted program relies on).
"""
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from parallelizer.errors import CaptureError, ModelFileError, UserError
from parallelizer.frontend.model_file import build_model, example_batch, load_model_file
from parallelizer.frontend.capture import capture


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source).lstrip("\n"))
    return path


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


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
    ("[1, 2, 3]", ["must hold tensors with a batch dim (dim 0)", "got int"]),
    ("(torch.tensor(3.0),)", ["must hold tensors with a batch dim (dim 0)", "got Tensor ()"]),
    ("{'x': torch.tensor(1)}", ["must hold tensors with a batch dim (dim 0)", "got Tensor ()"]),
    ("(torch.zeros(2, 8), 'mask')", ["must hold tensors with a batch dim (dim 0)", "got str"]),
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


# --- capture: failures point at model.py ----------------------------------------------------

DATA_DEPENDENT = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        {body}

def build_model():
    torch.manual_seed(0)
    return Model()

def example_inputs():
    return (torch.randn(2, 4, 16),)
"""


@pytest.mark.parametrize("body, failing", [
    ("if y.sum() > 0:\n            return y * 2\n        return y", "if y.sum() > 0:"),
    ("n = int(y.argmax().item())\n        return y.new_zeros(n)", "n = int(y.argmax().item())"),
], ids=["python_if_on_tensor", "item"])
def test_capture_error_names_model_file_and_line(tmp_path, body, failing):
    path = write(tmp_path, DATA_DEPENDENT.format(body=body))
    module = load_model_file(path)
    model = build_model(module, on_meta=False)
    with pytest.raises(CaptureError) as e:
        capture(model, example_batch(module), path)
    msg = str(e.value)
    assert msg.startswith(f"torch.export could not capture the model from {path}")
    assert f"{path.resolve()}:{line_of(path, failing)}: {failing}" in msg
    assert "Fix:" in msg and "data-dependent" in msg


# --- capture: success ------------------------------------------------------------------------

class TwoInputs(nn.Module):
    """Dict or tuple inputs; nested outputs (a tuple holding a dict)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.fc = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, ids, mask):
        h = self.norm(self.emb(ids))
        h = F.gelu(self.fc(h)) * mask.unsqueeze(-1)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return h, {"pooled": pooled}


def _two_inputs(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
    return ids, mask


def _assert_same(flat_got, structured_ref, out_spec):
    flat_ref, ref_spec = tree_flatten(structured_ref)
    assert len(flat_got) == len(flat_ref)
    for got, ref in zip(flat_got, flat_ref):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    rebuilt = tree_unflatten(list(flat_got), out_spec)
    assert isinstance(rebuilt, tuple) and set(rebuilt[1]) == {"pooled"}


@pytest.fixture(scope="module")
def two_inputs_model():
    torch.manual_seed(0)
    return TwoInputs().eval()


def test_capture_tuple_inputs_runs_other_batch_and_seq(two_inputs_model):
    model = two_inputs_model
    cap = capture(model, _two_inputs(2, 8, seed=0), Path(__file__))
    assert cap.route == "torch.export"
    assert cap.input_names == ("ids", "mask") and not cap.inputs_are_kwargs
    for batch, seq in [(5, 3), (1, 11)]:
        ids, mask = _two_inputs(batch, seq, seed=1)
        with torch.no_grad():
            flat = cap.gm(ids, mask)
            ref = model(ids, mask)
        assert isinstance(flat, tuple)
        _assert_same(flat, ref, cap.out_spec)


def test_capture_dict_inputs_runs_other_batch_and_seq(two_inputs_model):
    model = two_inputs_model
    ids, mask = _two_inputs(2, 8, seed=0)
    cap = capture(model, {"mask": mask, "ids": ids}, Path(__file__))
    assert cap.input_names == ("mask", "ids") and cap.inputs_are_kwargs
    ids, mask = _two_inputs(3, 13, seed=2)
    with torch.no_grad():
        flat = cap.gm(mask=mask, ids=ids)
        ref = model(ids=ids, mask=mask)
    _assert_same(flat, ref, cap.out_spec)
    placeholders = [n.target for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert tuple(placeholders) == cap.input_names


def test_capture_dict_inputs_callable_positionally(two_inputs_model):
    ids, mask = _two_inputs(2, 8, seed=0)
    cap = capture(two_inputs_model, {"ids": ids, "mask": mask}, Path(__file__))
    with torch.no_grad():
        flat = cap.gm(ids, mask)
        ref = two_inputs_model(ids, mask)
    _assert_same(flat, ref, cap.out_spec)


def test_captured_graph_has_metadata_the_passes_need(two_inputs_model):
    cap = capture(two_inputs_model, _two_inputs(2, 8, seed=0), Path(__file__))
    calls = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert all("val" in n.meta for n in calls)
    linear = next(n for n in calls if n.target is torch.ops.aten.linear.default)
    assert "nn_module_stack" in linear.meta
    # parameters are read by their original FQNs
    targets = {n.target for n in cap.gm.graph.nodes if n.op == "get_attr"}
    assert {"emb.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias"} <= targets
    # the guard call and the pytree codegen are gone: flat in, flat tuple out
    assert not any(n.op == "call_module" for n in cap.gm.graph.nodes)
    assert isinstance(cap.gm.graph.output_node().args[0], tuple)
