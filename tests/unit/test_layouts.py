"""Layout math: every element of the full tensor is held by exactly the ranks the layout says."""
import pytest
import torch

from parallelizer.checkpoint.slicing import local_piece
from parallelizer.plan.layouts import copied_heads, copied_runs, local_length, segments
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
    plan = _plan(t.shape, {"kind": "fused", "parts": [4, 4, 4]}, tp_dim=1)
    q, k, v = t.split(4, dim=1)
    for r in range(2):
        want = torch.cat([q.chunk(2, 1)[r], k.chunk(2, 1)[r], v.chunk(2, 1)[r]], dim=1)
        assert torch.equal(local_piece(t, plan, 2, r), want)
    assert segments(12, plan.layout, 2, 1) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]


def test_replicated_heads_each_rank_holds_one_whole_head():
    t = torch.arange(2 * 3 * 5.).reshape(6, 5)  # 2 kv heads of head_dim 3
    plan = _plan(t.shape, {"kind": "replicated_heads", "heads": 2, "head_dim": 3})
    pieces = [local_piece(t, plan, 4, r) for r in range(4)]
    assert plan.local_shape(4) == (3, 5)
    assert torch.equal(pieces[0], t[:3]) and torch.equal(pieces[1], t[:3])
    assert torch.equal(pieces[2], t[3:]) and torch.equal(pieces[3], t[3:])


def test_fused_part_of_copied_heads_is_held_whole_by_every_rank():
    # Falcon multi-query query_key_value: 4 q heads | 1 k head | 1 v head, head_dim 2
    t = torch.arange(12 * 3.).reshape(12, 3)
    rh = {"kind": "replicated_heads", "heads": 1, "head_dim": 2}
    plan = _plan(t.shape, {"kind": "fused", "parts": [8, 2, 2], "part_layouts": [None, rh, rh]})
    q, k, v = t.split([8, 2, 2])
    assert plan.local_shape(2) == (8, 3)
    for r in range(2):
        assert torch.equal(local_piece(t, plan, 2, r), torch.cat([q.chunk(2)[r], k, v]))
    assert segments(12, plan.layout, 2, 1) == [(4, 0, 4), (8, 4, 2), (10, 6, 2)]
    assert copied_runs(12, plan.layout, 2) == [(4, 2, 1), (6, 2, 1)]
    assert copied_runs(12, plan.layout, 4) == [(2, 2, 1), (4, 2, 1)]
    assert copied_heads(plan.layout) == {1} and copied_heads({"kind": "fused", "parts": [4]}) == set()
    assert copied_runs(12, {"kind": "fused", "parts": [4, 4, 4]}, 2) == []


def test_padded_rows_are_zero_and_cover_the_tensor_once():
    t = torch.arange(1., 11.).reshape(5, 2)  # vocab 5, tp 2 -> padded to 6
    plan = _plan(t.shape, {"kind": "padded", "padded_size": 6})
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
        local_length(n, layout, tp)
