"""--verify's tally (runtime/verify.py) on tensors it cannot compare: a gradient only one
side has, a shape difference — counted, named as the worst, error inf (a NaN compared
against 0 was counted but never became the worst, so the report named an unrelated tensor
with a tiny error, as for RoFormer's frozen position table)."""
import torch

from parallelizer.runtime.verify import _Tally


def test_a_gradient_only_one_side_has_is_named_as_the_worst():
    tally = _Tally(1e-5, 1e-5)
    tally.add("gradients", "a.weight", torch.ones(3) + 1e-8, torch.ones(3))
    tally.mismatch("gradients", "table: grad present in the program, None in the reference")
    tally.add("gradients", "b.weight", torch.ones(3) + 2e-8, torch.ones(3))
    assert tally.bad["gradients"] == 1 and tally.err["gradients"] == float("inf")
    assert tally.worst["gradients"].startswith("table: grad present in the program")


def test_a_shape_difference_is_named():
    tally = _Tally(1e-5, 1e-5)
    tally.add("parameters", "w", torch.ones(2, 3), torch.ones(3, 2))
    assert tally.bad["parameters"] == 1 and tally.worst["parameters"] == "w: shape (2, 3) vs (3, 2)"
