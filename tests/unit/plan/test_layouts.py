"""Layout math: every element of the full tensor is held by exactly the ranks the layout says;
each layout class's JSON round trip, its adaptation to another tp and the refusal of JSON
that is not a layout."""
import pytest
import torch

from parallelizer.checkpoint.slicing import local_piece
from parallelizer.plan.layouts import (Fused, InterleavedHeads, Padded, ReplicatedHeads, adapt,
                                       copied_heads, copied_runs, layout_from_json, local_length,
                                       segments)
from parallelizer.plan.parallel_plan import TensorPlan


def _plan(shape, layout, tp_dim=0):
    return TensorPlan("w", tuple(shape), "float32", tp_dim, (0,), layout=layout)


def test_even_split_matches_chunk():
    t = torch.arange(24.).reshape(12, 2)
    for r in range(3):
        assert torch.equal(local_piece(t, _plan(t.shape, None), 3, r), t.chunk(3)[r])


def test_fused_parts_are_split_separately():
    # GPT-2 c_attn: (in, 3h) Conv1D weight, q|k|v along dim 1
    t = torch.arange(2 * 12.).reshape(2, 12)
    plan = _plan(t.shape, Fused((4, 4, 4)), tp_dim=1)
    q, k, v = t.split(4, dim=1)
    for r in range(2):
        want = torch.cat([q.chunk(2, 1)[r], k.chunk(2, 1)[r], v.chunk(2, 1)[r]], dim=1)
        assert torch.equal(local_piece(t, plan, 2, r), want)
    assert segments(12, plan.layout, 2, 1) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]


def test_replicated_heads_each_rank_holds_one_whole_head():
    t = torch.arange(2 * 3 * 5.).reshape(6, 5)  # 2 kv heads of head_dim 3
    plan = _plan(t.shape, ReplicatedHeads(2, 3))
    pieces = [local_piece(t, plan, 4, r) for r in range(4)]
    assert plan.local_shape(4) == (3, 5)
    assert torch.equal(pieces[0], t[:3]) and torch.equal(pieces[1], t[:3])
    assert torch.equal(pieces[2], t[3:]) and torch.equal(pieces[3], t[3:])


def test_fused_part_of_copied_heads_is_held_whole_by_every_rank():
    # Falcon multi-query query_key_value: 4 q heads | 1 k head | 1 v head, head_dim 2
    t = torch.arange(12 * 3.).reshape(12, 3)
    rh = ReplicatedHeads(1, 2)
    plan = _plan(t.shape, Fused((8, 2, 2), (None, rh, rh)))
    q, k, v = t.split([8, 2, 2])
    assert plan.local_shape(2) == (8, 3)
    for r in range(2):
        assert torch.equal(local_piece(t, plan, 2, r), torch.cat([q.chunk(2)[r], k, v]))
    assert segments(12, plan.layout, 2, 1) == [(4, 0, 4), (8, 4, 2), (10, 6, 2)]
    assert copied_runs(12, plan.layout, 2) == [(4, 2, 1), (6, 2, 1)]
    assert copied_runs(12, plan.layout, 4) == [(2, 2, 1), (4, 2, 1)]
    assert copied_heads(plan.layout) == {1} and copied_heads(Fused((4,))) == set()
    assert copied_runs(12, Fused((4, 4, 4)), 2) == []


def test_padded_rows_are_zero_and_cover_the_tensor_once():
    t = torch.arange(1., 11.).reshape(5, 2)  # vocab 5, tp 2 -> padded to 6
    plan = _plan(t.shape, Padded(6))
    p0, p1 = (local_piece(t, plan, 2, r) for r in range(2))
    assert torch.equal(p0, t[:3])
    assert torch.equal(p1[:2], t[3:]) and torch.equal(p1[2], torch.zeros(2))


@pytest.mark.parametrize("layout, n, tp, msg", [
    ({"kind": "fused", "parts": [4, 4]}, 12, 2, "do not sum"),
    ({"kind": "fused", "parts": [3, 3]}, 6, 2, "does not divide a fused part"),
    ({"kind": "replicated_heads", "heads": 3, "head_dim": 2}, 6, 4, "heads dividing tp"),
    ({"kind": "padded", "padded_size": 4}, 5, 2, "padded_size 4 < dim size 5"),
    ({"kind": "zigzag"}, 4, 2, "unknown layout kind 'zigzag'"),
    ({"kind": "fused", "parts": [4, 2], "part_layouts": [None]}, 6, 2, "must give each of the parts"),
    ({"kind": "fused", "parts": [6, 2], "part_layouts": [None, {"kind": "replicated_heads", "heads": 2,
                                                               "head_dim": 1}]}, 8, 3, "heads dividing tp"),
])
def test_bad_layouts_are_refused(layout, n, tp, msg):
    with pytest.raises(ValueError, match=msg):
        local_length(n, layout_from_json(layout), tp)


RH = {"kind": "replicated_heads", "heads": 1, "head_dim": 2}


@pytest.mark.parametrize("data, typed", [
    (None, None),
    ({"kind": "fused", "parts": [4, 4, 4]}, Fused((4, 4, 4))),
    ({"kind": "fused", "parts": [8, 2, 2], "part_layouts": [None, RH, RH]},
     Fused((8, 2, 2), (None, ReplicatedHeads(1, 2), ReplicatedHeads(1, 2)))),
    ({"kind": "fused", "parts": [4, 4], "part_layouts": []}, Fused((4, 4), ())),  # = all even
    ({"kind": "interleaved_heads", "heads": 4}, InterleavedHeads(4)),
    ({"kind": "interleaved_heads", "heads": 2, "head_dim": 8}, InterleavedHeads(2, 8)),
    ({"kind": "replicated_heads", "heads": 2, "head_dim": 8}, ReplicatedHeads(2, 8)),
    ({"kind": "padded", "padded_size": 1002}, Padded(1002)),
    ({"kind": "padded", "padded_size": 1024, "multiple": 64}, Padded(1024, 64)),
])
def test_json_round_trip_is_exact(data, typed):
    # plan.json and manifest.json store exactly these keys: a round trip adds and drops none
    assert layout_from_json(data) == typed
    assert (typed.to_json() if typed else None) == data
    assert hash(layout_from_json(data)) == hash(typed)


@pytest.mark.parametrize("layout, n, tp, want", [
    (ReplicatedHeads(2, 4), 8, 2, InterleavedHeads(2, 4)),     # tp <= kv heads: even again
    (InterleavedHeads(2, 4), 8, 4, ReplicatedHeads(2, 4)),     # tp > kv heads: copies
    (InterleavedHeads(4), 12, 8, InterleavedHeads(4)),         # no head_dim: never copied
    (Padded(10), 10, 4, Padded(12)),
    (Padded(12), 10, 1, Padded(10)),
    (Padded(128, 64), 100, 4, Padded(256, 64)),
    (Fused((8, 2, 2), (None, ReplicatedHeads(1, 2), ReplicatedHeads(1, 2))), 12, 1,
     Fused((8, 2, 2), (None, InterleavedHeads(1, 2), InterleavedHeads(1, 2)))),
    (Fused((4, 4)), 8, 4, Fused((4, 4))),
    (None, 8, 4, None),
])
def test_adapt_to_another_tp(layout, n, tp, want):
    assert adapt(n, layout, tp) == want


@pytest.mark.parametrize("data, msg", [
    ([1, 2], "must be an object"),
    ({"parts": [4]}, "unknown layout kind None"),
    ({"kind": "fused", "parts": []}, "non-empty list"),
    ({"kind": "fused", "parts": [4, True]}, "positive int, got True"),
    ({"kind": "fused", "parts": [4, 0]}, "positive int, got 0"),
    ({"kind": "fused", "parts": [4, 4], "part_layouts": [None, {"kind": "padded", "padded_size": 4}]},
     "must give each of the parts"),
    ({"kind": "replicated_heads", "heads": 2}, "'head_dim' a positive int, got None"),
    ({"kind": "interleaved_heads", "heads": 2.0}, "'heads' a positive int, got 2.0"),
    ({"kind": "padded", "padded_size": -3}, "'padded_size' a positive int, got -3"),
    ({"kind": "padded", "padded_size": 8, "multiple": "2"}, "'multiple' a positive int"),
])
def test_json_that_is_not_a_layout_is_refused(data, msg):
    with pytest.raises(ValueError, match=msg):
        layout_from_json(data)


def test_tensor_plan_dict_round_trip_keeps_the_layout():
    rh = ReplicatedHeads(1, 2)
    t = _plan((12, 3), Fused((8, 2, 2), (None, rh, rh)))
    d = t.to_dict()
    assert d["layout"] == {"kind": "fused", "parts": [8, 2, 2], "part_layouts": [None, RH, RH]}
    assert TensorPlan.from_dict(d) == t


def test_pieces_side_by_side_are_one_fused_layout():
    from parallelizer.plan.layouts import local_offset, side_by_side
    # torch's cross-attention: q rows [0, 32) even, the kv rows [32, 96) fused [32, 32]
    layout = side_by_side(96, [(32, 96, Fused((32, 32))), (0, 32, None)])
    assert layout == Fused((32, 32, 32))
    assert [local_offset(b, layout, 4) for b in (0, 32, 96)] == [0, 8, 24]
    # a range covering the dim keeps its layout; rows no range reads are an even part
    assert side_by_side(8, [(0, 8, InterleavedHeads(2))]) == InterleavedHeads(2)
    assert side_by_side(12, [(0, 4, None)]) == Fused((4, 8))
    rh = ReplicatedHeads(1, 4)
    assert side_by_side(12, [(0, 4, None), (4, 8, rh), (8, 12, rh)]) == Fused((4, 4, 4),
                                                                                (None, rh, rh))


@pytest.mark.parametrize("ranges, msg", [
    ([(0, 8, None), (4, 12, None)], "overlaps"),
    ([(0, 4, None), (0, 12, None)], "overlaps"),  # a whole read beside a piece of it
    ([(0, 4, Padded(8)), (4, 12, None)], "cannot be a fused part")])
def test_pieces_that_cannot_be_side_by_side_are_refused(ranges, msg):
    from parallelizer.plan.layouts import side_by_side
    with pytest.raises(ValueError, match=msg):
        side_by_side(12, ranges)
