"""A Python branch on a tensor's values in forward (frontend/branches.py): ESM-2's
``if not padding_mask.any(): padding_mask = None`` stopped every capture route, so fair-esm's
models could not be compiled at all (zoo 15). The refusal names the line and the spec key;
with ``capture.data_dependent_branches: as_example`` the branch the example takes is
captured, the compile warns naming the line, and a batch that takes the other branch stops
with an error naming it, not with another model's numbers."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from parallelizer.compiler import compile_module
from parallelizer.errors import CaptureError
from parallelizer.frontend.branches import ASSUMED
from parallelizer.frontend.capture import capture
from parallelizer.frontend.spec import Spec


class _PaddingTest(nn.Module):
    """fairseq / ESM-2's padding test: the mask is dropped when no token is padding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
                                    for _ in range(2))

    def forward(self, ids):
        pad = ids.eq(0)
        x = self.emb(ids)
        if not pad.any():  # the line the messages name
            pad = None
        if pad is not None:
            x = x * (1 - pad.unsqueeze(-1).type_as(x))
        for block in self.blocks:
            x = x + block(x)
        return x


def _ids(padded: bool) -> torch.Tensor:
    ids = torch.randint(1, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[:, -2:] = 0
    return ids


def _line() -> str:
    import inspect
    source, start = inspect.getsourcelines(_PaddingTest.forward)
    return f"test_branches.py:{start + next(i for i, s in enumerate(source) if 'pad.any()' in s)}"


def test_a_branch_on_values_is_refused_naming_the_line_and_the_key():
    with pytest.raises(CaptureError) as e:
        capture(_PaddingTest(), (_ids(True),), Path("model.py"))
    message = str(e.value)
    assert "if not pad.any():" in message and "data-dependent" in message, message
    assert "capture.data_dependent_branches=as_example captures the branch the example batch " \
           "takes" in message, message


def test_as_example_captures_the_examples_branch_and_stops_a_batch_taking_the_other():
    model = _PaddingTest()
    captured = capture(model, (_ids(True),), Path("model.py"), branches="as_example")
    (decided,) = captured.gm.meta[ASSUMED]
    assert decided.startswith(f"{_line()}: if not pad.any():"), decided
    other = _ids(True)
    other[:, 0] = 0
    torch.testing.assert_close(captured.gm(other)[0], model(other), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=rf"this step takes another branch of the model's code "
                                           rf"than the example batch took at compile "
                                           rf"\(capture.data_dependent_branches: as_example\): "
                                           rf"{_line()}: if not pad.any\(\):"):
        captured.gm(_ids(False))


def test_as_example_compiles_at_tp2_with_a_warning_and_the_self_check():
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"tp": 2},
                                "capture": {"data_dependent_branches": "as_example"}})
    program = compile_module(_PaddingTest(), (_ids(True),), spec, reference=False)
    assert any(w.startswith(f"capture.data_dependent_branches: as_example: the capture took the "
                            f"branch the example batch takes at {_line()}: if not pad.any():")
               for w in program.warnings), program.warnings
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")], program.notes
    assert "4 of 4 weight matrices in blocks sharded" in program.report, program.report


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"dp": 2}])
def test_an_example_chunk_taking_the_other_branch_is_refused_at_compile(mesh):
    """Padding in one row only: the whole example takes the masked branch, the chunks a step
    is cut into (dp ranks, microbatches) without padding do not, and ``run.py --verify``
    stopped on the example itself (zoo 21 F2, fair-esm's ESM-2). Refused at compile, naming
    the chunk's rows, the line and the fix; padding in every chunk compiles."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": mesh, "pipeline": {"microbatches": 2},
                                "capture": {"data_dependent_branches": "as_example"}})
    one_row = _ids(False)
    one_row[3, -2:] = 0
    with pytest.raises(CaptureError, match=rf"as_example: the example batch takes the branch "
                                           rf"at {_line()}: if not pad.any\(\):.*, but its rows "
                                           rf"0\.\.\d, chunk 1 of the 2 .*padding in every chunk"):
        compile_module(_PaddingTest(), (one_row,), spec, reference=False)
    assert compile_module(_PaddingTest(), (_ids(True),), spec, reference=False).plan


class _BranchOnNoise(nn.Module):
    """A branch on a random draw: ST-MoE's router noise deciding ``F.one_hot``'s class count
    (``any``), or LayerDrop's ``torch.rand(1).item() <= p`` skipping a block (torchaudio's
    wav2vec2, a float the code reads). The example's draw decided it at capture, another
    draw decides it otherwise."""

    def __init__(self, layer_drop: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
                                    for _ in range(2))
        self.layer_drop = layer_drop

    def forward(self, x):
        if not self.layer_drop and (torch.rand(8) > 0.6).any():
            x = x * 2
        for block in self.blocks:
            if not (self.layer_drop and torch.rand(1).item() <= 0.2):
                x = x + block(x)
        return x


@pytest.mark.parametrize("layer_drop", [False, True])
def test_a_branch_on_a_random_draw_is_refused_at_capture_naming_it(layer_drop):
    """Refused by the self-check (its random ops fixed, it stopped at the decided branch)
    as the model's error before, for ST-MoE (zoo 15); LayerDrop's draw, a float, reached it
    unlabelled: an internal error at the self-check, or "Runtime assertion failed for
    expression 0.2 < zuf0" on a later training step (zoo 22 F5). The condition reads a draw:
    refused at capture (decision 225)."""
    torch.manual_seed(0)
    spec = Spec.model_validate({"mesh": {"tp": 2},
                                "capture": {"data_dependent_branches": "as_example"}})
    with pytest.raises(CaptureError) as e:
        compile_module(_BranchOnNoise(layer_drop), (torch.randn(4, 3, 16),), spec,
                       reference=False)
    message = str(e.value)
    assert re.search(r"the branch at test_branches\.py:\d+ is decided by a random draw "
                     r"\(aten\.rand\.default at test_branches\.py:\d+\).*Set that probability "
                     r"to 0", message), message


class _BranchOnAFloat(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.abs().max().item() > 3.0:  # a float the code reads, decided by the example
            x = x / 2
        return self.fc(x)


def test_a_float_condition_taking_the_other_branch_names_the_line():
    """The assertion draft_export keeps on a float (``zuf0``) is labelled like one on an int:
    it said "Runtime assertion failed for expression 3.0 < zuf0 on node 'gt'"."""
    big = torch.full((2, 16), 4.0)
    captured = capture(_BranchOnAFloat(), (big,), Path("model.py"), branches="as_example")
    with pytest.raises(RuntimeError, match=r"this step takes another branch .*"
                                           r"test_branches\.py:\d+: if x\.abs\(\)\.max\(\)"):
        captured.gm(torch.zeros(2, 16))


def test_without_weights_the_branch_is_named_not_blamed_on_the_model():
    """On the meta device (--no-weights) the eager run cannot read a value either: the
    refusal said the model "fails on example_inputs() when it runs as it is". It is the
    capture's refusal, and as_example says it needs the weights."""
    model, ids = _PaddingTest().to("meta"), _ids(True).to("meta")
    with pytest.raises(CaptureError) as e:
        capture(model, (ids,), Path("model.py"))
    assert "could not capture" in str(e.value) and "runs as it is" not in str(e.value), e.value
    with pytest.raises(CaptureError, match=r"as_example decides the branch by the example's "
                                           r"values, which a compile without the weights "
                                           r"\(--no-weights, on the meta device\) does not have"):
        capture(model, (ids,), Path("model.py"), branches="as_example")


class _LazyInit(nn.Module):
    """routing-transformer's k-means: centroids initialised from the first batch a fresh
    model sees (``if not self.initted``), then kept. draft_export runs the forward on real
    values beside the fake ones; that run initialised the buffers, so the capture took the
    initialised branch while the unmodified model (fresh) takes the other, and the
    checkpoint held centroids from the example batch (zoo 16 Z9)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("means", torch.zeros(16))
        self.register_buffer("initted", torch.tensor(False))

    def forward(self, x):
        if not self.initted:
            with torch.no_grad():
                self.means.copy_(x.mean(dim=(0, 1)))
                self.initted.fill_(True)
        return x + self.fc(x - self.means)


def test_as_example_leaves_buffers_as_they_were_and_takes_the_fresh_models_branch():
    torch.manual_seed(0)
    model = _LazyInit()
    cap = capture(model, (torch.randn(4, 8, 16) + 3.0,), Path("model.py"), branches="as_example")
    assert not model.initted and model.means.abs().sum() == 0, "the capture wrote the buffers"
    assert any(n.target is torch.ops.aten.copy_.default for n in cap.gm.graph.nodes), \
        "the capture took the branch of an initialised model"



class _LazyInitStack(nn.Module):
    """Two lazily initialised blocks, the second's centroids taken under no_grad from the
    first's output: a gradient path the model does not have."""

    def __init__(self, block=_LazyInit):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


class _DataWrites(_LazyInit):
    """routing-transformer's writes, through ``.data``: ``_version`` stays where it was, and
    the capture's plain eager run (after every route failed) initialised the buffers unseen."""

    def forward(self, x):
        if not self.initted:
            with torch.no_grad():
                self.means.data.copy_(x.mean(dim=(0, 1)))
                self.initted.data.copy_(torch.tensor(True))
        return x + self.fc(x - self.means)


def _lazy_batch() -> tuple:
    return (torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)) + 3.0,)


@pytest.mark.parametrize("branches", ["refuse", "as_example"])
def test_a_branch_on_a_buffers_value_is_not_decided_by_symbolic_trace(branches):
    """symbolic_trace, capture's second route, read ``self.initted`` as a Python bool at trace
    time: the fresh model's branch became the program's with no warning. Refused (draft_export
    fails on the ``.data`` writes, inside torch), the model's buffers as they were."""
    model, fresh = _LazyInitStack(_DataWrites), _LazyInitStack(_DataWrites)
    with pytest.raises(CaptureError, match=r"if not self.initted") as e:
        capture(model, _lazy_batch(), Path("model.py"), branches=branches)
    for (name, b), f in zip(model.named_buffers(), fresh.buffers()):
        assert torch.equal(b, f), f"the capture wrote {name}"
    if branches == "as_example":  # torch's own failure, located, and the way round it
        assert "(StopIteration: raised in torch/_export/" in str(e.value), e.value
        assert "initialise it in build_model() (one forward on a batch)" in str(e.value)


def test_a_lazy_state_initialised_in_build_model_is_captured_under_as_example():
    model = _LazyInitStack(_DataWrites)
    model(*_lazy_batch())
    cap = capture(model, _lazy_batch(), Path("model.py"), branches="as_example")
    assert [line.split(": ", 1)[1] for line in cap.gm.meta[ASSUMED]] == \
        ["if not self.initted: (on the example batch Eq(u0, 1) is True)"]


def test_as_example_keeps_the_no_grad_region_of_a_lazy_initialisation():
    model, fresh = _LazyInitStack(), _LazyInitStack()
    cap = capture(model, _lazy_batch(), Path("model.py"), branches="as_example")
    assert [line.split(": ", 1)[1] for line in cap.gm.meta[ASSUMED]] == \
        ["if not self.initted: (on the example batch Eq(u0, 1) is False)"]
    cap.gm(*_lazy_batch())[0].backward()
    fresh(*_lazy_batch()).backward()
    for (name, p), f in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p.grad, f.grad, rtol=1e-6, atol=1e-6, msg=name)


class _Lengths(nn.Module):
    """torchaudio's wav2vec2 given ``lengths``: the frames' lengths computed from the
    samples', a padding mask written from them, and a branch: draft_export fails too
    (PendingUnbackedSymbolNotFound), and the refusal named no line (zoo 22 F4)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv1d(1, 8, 4, stride=2), nn.Linear(8, 8)

    def forward(self, wave, lengths):
        x = self.conv(wave.unsqueeze(1)).transpose(1, 2)
        lengths = torch.div(lengths - 4, 2, rounding_mode="floor") + 1
        x[torch.arange(x.shape[1])[None] >= lengths[:, None]] = 0.0
        if lengths.max() > 5:
            x = x * 2
        return self.fc(x), lengths


def test_as_example_failing_as_well_names_the_line_it_failed_at():
    batch = (torch.randn(4, 40), torch.tensor([40, 30, 20, 40]))
    with pytest.raises(CaptureError) as e:
        capture(_Lengths(), batch, Path("model.py"), branches="as_example")
    assert re.search(r"as_example the capture fails as well \(.*\)\n  at \S*test_branches\.py:"
                     r"\d+: lengths = torch\.div", str(e.value)), str(e.value)
