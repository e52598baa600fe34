"""Input sizes the model's code bounds (analysis/input_bounds.py): run.py refuses a
--seq-len / --batch-size beyond them before any forward.

A break test compiled a model adding ``self.pos[:, :T]`` (a learned table of 16 positions) at
the example's length 8; ``run.py --train --seq-len 32`` then crashed inside the forward on
every rank ("The size of tensor a (16) must match the size of tensor b"). GPT-2's
``wpe(arange(T))`` has no guard at all: a longer sequence is an index error on CPU and a
device-side assert on CUDA.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from parallelizer.analysis.input_bounds import size_ranges
from parallelizer.emit.report import _size_lines
from parallelizer.errors import UserError
from parallelizer.runtime.data_source import check_fixed_sizes
from tp_small_models import captured, line_of

V, D, P = 32, 16, 16


class Base(nn.Module):
    def __init__(self, rows=P):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(1, rows, D))
        self.wpe = nn.Embedding(rows, D)
        self.head = nn.Linear(D, V)


class SlicedTable(Base):
    def forward(self, ids):
        return self.head(self.emb(ids) + self.pos[:, :ids.shape[1]])


class LookedUp(Base):  # GPT-2
    def forward(self, ids):
        return self.head(self.emb(ids) + self.wpe(torch.arange(ids.shape[1]).unsqueeze(0)))


class OffsetByTwo(Base):  # OPT: positions from a cumsum of the mask, offset by 2
    def forward(self, ids):
        mask = torch.ones(ids.shape, dtype=torch.long)
        positions = torch.cumsum(mask, dim=1) * mask - 1
        return self.head(self.emb(ids) + self.wpe(positions + 2))


class Asserted(Base):  # nanoGPT
    def forward(self, ids):
        assert ids.shape[1] <= 12, "longer than block_size"
        return self.head(self.emb(ids))


class Unbounded(Base):
    def forward(self, ids):
        return self.head(self.emb(ids) * torch.arange(ids.shape[1]).unsqueeze(-1))


class FirstFourPositions(Base):  # a partial slice: any length runs
    def forward(self, ids):
        return self.head(self.emb(ids) + self.wpe(torch.arange(ids.shape[1])[:4]).mean(0))


class SlotsPerSample(Base):
    def forward(self, ids):
        return self.head(self.emb(ids) + self.wpe.weight[:ids.shape[0]].unsqueeze(1))


class RelativeTable(Base):  # a learned bias per relative position, 2 P - 1 of them
    def __init__(self, same=False):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(2, 2 * P - 1))
        self.same = same

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        # pos - pos is 0 everywhere: the table's middle column at every length
        rel = (pos - pos) if self.same else pos[None, :] - pos[:, None]
        bias = self.rel[:, rel + P - 1]  # (2, T, T) or (2, T)
        return self.head(self.emb(ids)) + bias.mean(0).mean(-1, keepdim=True).unsqueeze(0)


def _ids(b=2, t=8):
    return (torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(0)),)


def _plan(ranges, dp=1, m=1):
    return type("Plan", (), {"mesh": {"dp": dp}, "microbatches": m, "fixed_sizes": (),
                             "size_ranges": ranges, "size_guards": (), "sequence_dims": ()})


def test_a_sliced_position_table_bounds_the_sequence_and_run_refuses_beyond():
    c = captured(SlicedTable(), _ids())
    line = line_of(__file__, "self.pos[:, :ids.shape[1]]")
    ranges = size_ranges(c.gm, c.input_names)
    assert ranges == (("ids", 1, 2, P, f"aten.slice.Tensor at test_input_bounds.py:{line}"),)
    check_fixed_sizes(_plan(ranges), 4, P, "--batch-size", "--seq-len")
    with pytest.raises(UserError, match=(
            r"^--seq-len 17: the model's code accepts the sequence length 2\.\.16 of input 'ids' "
            r"\(aten\.slice\.Tensor at test_input_bounds\.py:\d+\): a bound in the captured "
            r"graph .*use a sequence length in that range$")):
        check_fixed_sizes(_plan(ranges), None, P + 1, "--batch-size", "--seq-len")
    assert _size_lines(_plan(ranges)) == [
        f"- input 'ids': the model's code accepts the sequence length 2..16 (aten.slice.Tensor "
        f"at test_input_bounds.py:{line}); run.py refuses another --seq-len"]


@pytest.mark.parametrize("model, rows, high", [(LookedUp, P, P), (OffsetByTwo, P + 2, P),
                                               (OffsetByTwo, P, P - 2)])
def test_positions_looked_up_in_a_table_bound_the_sequence(model, rows, high):
    """No export guard: the bound is where the largest position id, ``T - 1 + offset``,
    reaches the table's last row."""
    c = captured(model(rows), _ids())
    (name, d, low, got, where), = size_ranges(c.gm, c.input_names)
    assert (name, d, low, got) == ("ids", 1, 2, high)
    assert where.startswith(f"aten.embedding.default of {rows} rows at test_input_bounds.py:")
    ids = torch.randint(0, V, (1, high))
    model(rows).eval()(ids)  # the bound is the longest the model itself runs ...
    with pytest.raises(IndexError):
        model(rows).eval()(torch.randint(0, V, (1, high + 1)))  # ... and one more fails in it


def test_relative_positions_indexing_a_table_bound_the_sequence():
    """``rel[:, (pos[None, :] - pos[:, None]) + P - 1]``: every pair of positions, so the
    largest index is ``(T - 1) - 0 + P - 1``; the table's 2 P - 1 columns run lengths up to
    P. A longer one was an IndexError inside the forward, not refused (zoo 24 F4). The
    same positions subtracted from themselves reach the middle column only: no bound."""
    c = captured(RelativeTable(), _ids())
    (name, d, low, high, where), = size_ranges(c.gm, c.input_names)
    assert (name, d, low, high) == ("ids", 1, 2, P)
    assert where.startswith(f"aten.index.Tensor of {2 * P - 1} rows at test_input_bounds.py:")
    RelativeTable().eval()(torch.randint(0, V, (1, P)))
    with pytest.raises(IndexError):
        RelativeTable().eval()(torch.randint(0, V, (1, P + 1)))
    c = captured(RelativeTable(same=True), _ids())
    assert size_ranges(c.gm, c.input_names) == ()
    RelativeTable(same=True).eval()(torch.randint(0, V, (1, 4 * P)))


def test_an_assert_bounds_the_sequence():
    c = captured(Asserted(), _ids())
    assert [r[:4] for r in size_ranges(c.gm, c.input_names)] == [("ids", 1, 2, 12)]


def test_a_model_without_bounds_has_none():
    c = captured(Unbounded(), _ids())
    assert size_ranges(c.gm, c.input_names) == ()
    FirstFourPositions()(torch.randint(0, V, (1, 2 * P)))  # runs past the table's rows ...
    c = captured(FirstFourPositions(), _ids())
    assert all(r[3] is None for r in size_ranges(c.gm, c.input_names))  # ... so no bound
    check_fixed_sizes(_plan(()), 1024, 4096, "--batch-size", "--seq-len")


def test_a_bounded_batch_is_checked_per_microbatch_and_dp_rank():
    c = captured(SlotsPerSample(), _ids(b=4))
    ranges = size_ranges(c.gm, c.input_names)
    assert [r[:4] for r in ranges] == [("ids", 0, 2, P)]
    check_fixed_sizes(_plan(ranges, dp=2, m=2), 64, None, "--batch-size", "--seq-len")
    with pytest.raises(UserError, match=r"^--batch-size 68 \(17 per microbatch and dp rank\): "
                                        r"the model's code accepts the batch size 2\.\.16"):
        check_fixed_sizes(_plan(ranges, dp=2, m=2), 68, None, "--batch-size", "--seq-len")


def test_gpt2_and_bert_from_transformers_are_bounded_by_their_position_tables():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=P, use_cache=False))
    bert = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        vocab_size=V, max_position_embeddings=P))
    for model in (gpt2, bert):
        c = captured(model, {"input_ids": _ids()[0]})
        assert [r[:4] for r in size_ranges(c.gm, c.input_names)] == [("input_ids", 1, 2, P)]
