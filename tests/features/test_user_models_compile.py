"""Issue 14, single process: what the program must import (custom-op libraries, output
types), contiguous stage outputs, and tensor-parallel planning around MoE routers and
custom operators. The multi-process runs are tests/distributed/test_user_models.py."""
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from parallelizer.compiler import compile_model
from parallelizer.frontend.capture import capture
from parallelizer.plan.parallel_plan import MODEL_MODULE
from parallelizer.runtime.imports import import_modules
from parallelizer.analysis.needed_imports import modules_needed
from parallelizer.planning.tp import plan_tp
from parallelizer.frontend.spec import load_spec

MODELS = Path(__file__).resolve().parents[1] / "distributed" / "user_models"

# a library that registers a custom op when imported (as transformers.integrations.moe
# registers transformers::grouped_mm_fallback), and a model whose forward calls it
_LIB = """
    import torch

    @torch.library.custom_op("i14test::scale_rows", mutates_args=())
    def scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @scale_rows.register_fake
    def _(x, w):
        return torch.empty_like(x)
"""


@pytest.fixture(scope="module")
def custom_op_lib(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lib")
    (folder / "i14_custom_op_lib.py").write_text(textwrap.dedent(_LIB))
    sys.path.insert(0, str(folder))
    yield importlib.import_module("i14_custom_op_lib")
    sys.path.remove(str(folder))


class _CustomOpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.ops.i14test.scale_rows(self.fc(x), self.w)


def test_program_imports_custom_op_library_and_output_type(custom_op_lib, tmp_path):
    """run.py failed with "'_OpNamespace' 'transformers' object has no attribute
    'grouped_mm_fallback'" and "Deserializing ...CausalLMOutputWithPast in pytree is not
    registered" when model.py never imported those modules itself."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    captured = capture(_CustomOpNet(), (torch.randn(2, 3, 8),), tmp_path / "model.py")
    # the output structure of a Hugging Face causal LM, as capture records it
    _, out_spec = tree_flatten(CausalLMOutputWithPast(logits=torch.ones(1)))
    needed = modules_needed(captured.gm.graph, out_spec, MODEL_MODULE)
    assert needed == ("i14_custom_op_lib", "transformers.modeling_outputs")
    # the parameter the custom op reads has no sharding rule: replicated, and reported
    report = plan_tp(captured.gm.graph, 2, allow_replicated=True).report
    assert "kept replicated: w (read by i14test.scale_rows, an operator with no " \
           "tensor-parallel sharding rule)" in report


def test_missing_module_is_named_with_the_fix():
    msg = import_modules(["transformers.modeling_outputs", "no_such_module_i14"])
    assert msg.startswith("this program needs module no_such_module_i14 ")
    assert "ModuleNotFoundError" in msg and "install the package" in msg
    assert import_modules(["transformers.modeling_outputs"]) is None


class _MoEBlock(nn.Module):
    """A router (softmax + top-k over experts), one expert MLP and a one-feature gate."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.shared_gate = nn.Linear(16, 1)

    def forward(self, x):
        weights, _ = torch.topk(F.softmax(self.router(x), dim=-1), 2)
        h = self.down(F.relu(self.up(x)))
        return x + h * weights.sum(-1, keepdim=True) * torch.sigmoid(self.shared_gate(x))


def test_router_and_scalar_gate_stay_replicated_and_leave_the_next_block_sharded(tmp_path):
    """The router's walk went on through the combine and the residual into the next block
    and took its column linear as a row: that block's MLP stayed replicated."""
    model = nn.Sequential(_MoEBlock(), _MoEBlock())
    captured = capture(model, (torch.randn(2, 3, 16),), tmp_path / "model.py")
    d = plan_tp(captured.gm.graph, 2)
    assert d.column == {"0.up.weight", "1.up.weight"}
    assert d.row == {"0.down.weight", "1.down.weight"}
    assert any(line.startswith("replicated linear: 1.router.weight (no column/row pair found")
               for line in d.report), d.report
    assert any(line.startswith("replicated linear: 0.shared_gate.weight (no column/row pair found")
               for line in d.report), d.report


_TRANSPOSING = """
    import torch
    from torch import nn
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
        def forward(self, x):  # returns (B, S, 8) laid out as (S, B, 8): strided
            return (x + self.fc(x)).transpose(0, 1).contiguous().transpose(0, 1)
    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(*(Block() for _ in range(4)))
    def example_inputs():
        return (torch.randn(4, 6, 8),)
"""


def test_stage_outputs_not_known_contiguous_are_sent_contiguous(tmp_path):
    """gloo's isend refused T5's transposed stage output ('input tensor has to be
    contiguous'); the emitted stage returns contiguous(x), outside the block's class."""
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_TRANSPOSING))
    spec = load_spec(MODELS / "spec.yaml", ["mesh.pp=2"])
    program = compile_model(path, spec, weights=False)
    stage0 = program.sources["program/stage0.py"]
    stage_body = stage0.split("class Stage0")[1]
    # on the last block's output, in the stage's own forward (block classes unchanged)
    assert "torch.ops.aten.contiguous.default(_1)" in stage_body
    assert "contiguous" not in program.sources["program/stage1.py"]  # last stage: outputs as they are


def test_default_loss_is_the_loss_the_model_computed():
    """A model called with labels= returns outputs.loss: that is the training loss (before,
    the default took the mean square of the first float output, the loss itself)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from parallelizer.frontend.model_file import default_loss
    logits = torch.randn(2, 3, 5)
    loss = torch.tensor(1.5)
    assert default_loss(CausalLMOutputWithPast(loss=loss, logits=logits), None) is loss
    assert default_loss((logits, loss), None) is loss  # a 0-dim float output
    assert torch.equal(default_loss(CausalLMOutputWithPast(logits=logits), None), logits.pow(2).mean())
