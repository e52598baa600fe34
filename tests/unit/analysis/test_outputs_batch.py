"""Under pp > 1 the stages run on microbatches, so the captured graph must keep the batch a
symbol and every output must be per sample (analysis/outputs.py).

- rtdl's FT-Transformer appends its CLS token with ``weight.view(1, -1).expand(len(x), 1,
  -1)``: ``len()`` must return an int, so torch.export fixes the batch at the example's
  size, and the pipelined stage failed on the microbatch's shapes ("internal error ... at
  aten.cat"; the zoo's ft_transformer at pp2 and tp2 x pp2). Now a compile error naming the
  first op sized by the constant, its line, and the fix.
- A sequence length the model's code fixes (``x.reshape(b, 5, H)``) ran at the example's length
  and crashed on every rank under ``run.py --train --seq-len 32`` (a new-user break test). Now
  the compile warns naming the op, the plan records the size and run.py refuses another.
- CLIP returns ``logits_per_image`` (batch, batch): under pp each microbatch paired only its
  own images and texts, and ``--verify`` FAILed (outputs, loss, every gradient; zoo
  clip_dual at pp2 and tp2 x pp2). Now a compile error naming the output.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelizer.analysis.outputs import (check_batch_is_dynamic, check_outputs_have_batch_dim,
                                           fixed_size_warnings, fixed_sizes)
from parallelizer.errors import PlanError, UserError
from parallelizer.runtime.data_source import check_fixed_sizes
from tp_small_models import H, captured, line_of


class ClsByLen(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(H))
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        cls = self.cls.view(1, 1, -1).expand(len(x), 1, -1)  # the batch as a Python int
        return self.lin(torch.cat([x, cls], dim=1))


class ClsByShape(ClsByLen):
    def forward(self, x):
        return self.lin(torch.cat([x, self.cls.view(1, 1, -1).expand(x.shape[0], 1, -1)], dim=1))


class Similarity(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x, y):
        return self.a(x.mean(1)) @ self.b(y.mean(1)).t()


def _x(b=4):
    return (torch.randn(b, 5, H, generator=torch.Generator().manual_seed(0)),)


def test_a_batch_fixed_by_len_is_refused_naming_the_line():
    c = captured(ClsByLen(), _x())
    with pytest.raises(PlanError) as e:
        check_batch_is_dynamic(c.gm, c.input_names)
    msg = str(e.value)
    line = line_of(__file__, "# the batch as a Python int")
    assert msg.startswith("the model's code fixes the batch size at the example's 4"), msg
    assert f"aten.expand.default at test_outputs_batch.py:{line}" in msg and "len(x)" in msg \
        and "mesh.pp=1, mesh.dp=1 and pipeline.microbatches=1" in msg, msg


def test_a_symbolic_batch_passes():
    c = captured(ClsByShape(), _x())
    check_batch_is_dynamic(c.gm, c.input_names)
    check_outputs_have_batch_dim(c.gm, c.input_names)


def test_an_output_over_pairs_of_samples_is_refused():
    c = captured(Similarity(), _x() + _x())
    line = line_of(__file__, "self.a(x.mean(1)) @ self.b(y.mean(1)).t()")
    with pytest.raises(PlanError, match=rf"output 0 of the model \(made by aten\.[\w.]+ at "
                                        rf"test_outputs_batch.py:{line}\) has shape \[\w+, \w+\] "
                                        r"\(torch.float32\): its dim 1 is the batch too"):
        check_outputs_have_batch_dim(c.gm, c.input_names)


class SeqByConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(x.reshape(x.shape[0], 5, H))  # the sequence length as a constant


class Channels(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).flatten(1)


def test_a_sequence_length_fixed_by_the_code_is_warned_and_refused_at_run():
    c = captured(SeqByConstant(), _x())
    fixed = fixed_sizes(c.gm, c.input_names)
    assert fixed == (("x", 1, 5, True),)
    line = line_of(__file__, "return self.lin(x.reshape(x.shape[0], 5, H))")
    assert fixed_size_warnings(fixed, c.gm) == [
        f"the model's code fixes the sequence length at the example's 5 (dim 1 of input 'x' is a "
        f"constant in the captured graph: a layer over that dim (a Linear mixing the tokens), a "
        f"Python loop over it, or a size written as a number; the first op sized by it: "
        f"aten.reshape.default at test_outputs_batch.py:{line}); the program runs only that "
        f"sequence length, and run.py refuses another --seq-len or data.seq_len. Size by the "
        f"tensor (x.shape[1]) to run any"]
    plan = type("Plan", (), {"mesh": {"dp": 1}, "microbatches": 1,
                             "fixed_sizes": tuple(f[:3] for f in fixed), "size_ranges": (),
                             "size_guards": (), "sequence_dims": ()})
    check_fixed_sizes(plan, 8, 5, "--batch-size", "--seq-len")
    check_fixed_sizes(plan, None, None, "--batch-size", "--seq-len")
    with pytest.raises(UserError, match=r"^--seq-len 32: the program runs only the sequence "
                                        r"length 5 of input 'x', which the model's code fixes "
                                        r"\(a constant in the captured graph, or a condition "
                                        r"torch.export guarded on it"):
        check_fixed_sizes(plan, None, 32, "--batch-size", "--seq-len")


class SeqByTable(nn.Module):
    """A learned position table added to the stream: broadcasting fixes the length there."""

    def __init__(self):
        super().__init__()
        self.pos, self.lin = nn.Parameter(torch.zeros(1, 5, H)), nn.Linear(H, H)

    def forward(self, x):
        h = x + self.pos  # the table fixes the length
        return self.lin(h.reshape(x.shape[0], 5, H))


def test_the_warning_names_the_table_that_fixes_the_length_not_a_later_view():
    c = captured(SeqByTable(), _x())
    (warning,) = fixed_size_warnings(fixed_sizes(c.gm, c.input_names), c.gm)
    line = line_of(__file__, "h = x + self.pos")
    assert f"the first op sized by it: aten.add.Tensor at test_outputs_batch.py:{line})" in warning


class ImageByConstant(Channels):
    def forward(self, x):  # 3 channels, and a 3 in a view: no claim about which op fixed what
        return self.conv(x).reshape(x.shape[0], 4, -1).flatten(1)


@pytest.mark.parametrize("model", [Channels, ImageByConstant])
def test_an_images_channels_are_recorded_without_a_warning(model):
    """An image's channels (dim 1) are fixed by its first conv: recorded (run.py refuses a
    --seq-len, which sets dim 1) but not warned about, whatever literal the code holds."""
    c = captured(model(), (torch.randn(2, 3, 8, 8),))
    fixed = fixed_sizes(c.gm, c.input_names)
    assert fixed == (("x", 1, 3, False),)
    assert fixed_size_warnings(fixed) == []


class FeaturesBesideIds(nn.Module):
    """Token ids (B, T) and a feature vector (B, 5) read by a Linear(5, H): the 5 is no
    sequence length ('fixes the sequence length at 5' before, and --seq-len 8 refused with
    'use 5' though the ids' length was free: a break test)."""

    def __init__(self):
        super().__init__()
        self.emb, self.feat = nn.Embedding(32, H), nn.Linear(5, H)

    def forward(self, ids, feats):
        return self.emb(ids) + self.feat(feats).unsqueeze(1)


def test_a_fixed_dim_1_beside_a_free_sequence_is_no_sequence_length():
    c = captured(FeaturesBesideIds(), (torch.randint(0, 32, (2, 7)), torch.randn(2, 5)))
    assert fixed_sizes(c.gm, c.input_names) == ()


def test_a_2d_float_inputs_features_are_recorded_without_a_warning():
    """An MLP on (batch, features) rows: dim 1 is features fixed by its first Linear, not a
    sequence ('fixes the sequence length at 8' was warned: a break test)."""
    mlp = nn.Sequential(nn.Linear(8, H), nn.ReLU(), nn.Linear(H, 4))
    c = captured(mlp, (torch.randn(32, 8),))
    fixed = fixed_sizes(c.gm, c.input_names)
    assert fixed == (("input_1", 1, 8, False),) and fixed_size_warnings(fixed) == []


def test_seq_len_resizes_the_sequence_inputs_only():
    """--seq-len sets dim 1 of the inputs whose dim 1 is the first input's: the ids, not
    the (B, 5) features (the forward failed on a (B, 8) feature input before)."""
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    from parallelizer.runtime.batching import flatten
    from parallelizer.runtime.data_source import _resized
    example = (torch.randint(0, 32, (2, 7)), torch.randn(2, 5))
    program = compiler.compile_module(FeaturesBesideIds(), example,
                                      Spec.model_validate({"mesh": {"tp": 1}}), reference=False)
    ids, feats = flatten(program.plan, _resized(program.plan, example, 3, 8))
    assert tuple(ids.shape) == (3, 8) and tuple(feats.shape) == (3, 5)


class ChannelsFirstBesideIds(nn.Module):
    """Whisper's spelling: input_features (B, 16 mel bins, frames) first, read by a
    Conv1d(16, ..), beside labels (B, 16) whose 16 is a free sequence. --seq-len resized the
    first input's dim 1 because the labels' length equals it, and the step died in the
    conv ("expected input[2, 32, 24] to have 16 channels", zoo 14 F10)."""

    def __init__(self):
        super().__init__()
        self.conv, self.emb = nn.Conv1d(16, H, 3, padding=1), nn.Embedding(64, H)

    def forward(self, x, ids):
        return self.conv(x).mean(2, keepdim=True).transpose(1, 2) + self.emb(ids)


def test_seq_len_leaves_a_dim_the_graph_holds_as_a_number():
    from parallelizer import compiler
    from parallelizer.frontend.spec import Spec
    from parallelizer.runtime.batching import flatten
    from parallelizer.runtime.data_source import _resized
    example = (torch.randn(2, 16, 24), torch.randint(0, 64, (2, 16)))
    program = compiler.compile_module(ChannelsFirstBesideIds(), example,
                                      Spec.model_validate({"mesh": {"tp": 1}}), reference=False)
    assert ("x", 1) in set(map(tuple, program.plan.static_dims))
    x, ids = flatten(program.plan, _resized(program.plan, example, 3, 32))
    assert tuple(x.shape) == (3, 16, 24) and tuple(ids.shape) == (3, 32)
