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


def test_a_nan_in_the_program_is_the_worst_not_an_error_of_zero():
    """A program gradient with a nan where the reference is finite was counted, but its
    error (nan) never exceeded another: the report read "max abs err 0", worst "-"."""
    tally = _Tally(1e-5, 1e-5)
    tally.add("gradients", "a.weight", torch.ones(3) + 1e-3, torch.ones(3))
    tally.add("gradients", "b.weight", torch.tensor([1.0, float("nan")]), torch.ones(2))
    assert tally.bad["gradients"] == 2 and tally.err["gradients"] == float("inf")
    assert tally.worst["gradients"] == "b.weight (nan where the reference is finite)"


def test_a_shape_difference_is_named():
    tally = _Tally(1e-5, 1e-5)
    tally.add("parameters", "w", torch.ones(2, 3), torch.ones(3, 2))
    assert tally.bad["parameters"] == 1 and tally.worst["parameters"] == "w: shape (2, 3) vs (3, 2)"


def test_the_absolute_tolerance_scales_with_the_tensors_magnitude():
    """DeiT's distillation token gradient at tp2: magnitude 200, an element near zero off by
    2.3e-4 (fp32 rounding of the terms it is summed from) is within; a wrongly scaled
    gradient, or one element off by 1e-3 of the magnitude, is not."""
    from parallelizer.runtime.verify import within
    want = torch.tensor([200.0, -150.0, 3e-3])
    assert within(want + torch.tensor([0.0, 0.0, 2.3e-4]), want, 1e-5, 1e-5)
    assert not torch.allclose(want + torch.tensor([0.0, 0.0, 2.3e-4]), want, atol=1e-5, rtol=1e-5)
    assert not within(want * 2, want, 1e-5, 1e-5)
    assert not within(want + torch.tensor([0.0, 0.0, 0.2]), want, 1e-5, 1e-5)
    small = torch.tensor([0.5, 1e-3])  # magnitude below 1: the spec's atol as given
    assert not within(small + torch.tensor([0.0, 2e-5]), small, 1e-5, 1e-5)
    tally = _Tally(1e-5, 1e-5)
    tally.add("gradients", "deit.embeddings.distillation_token",
              want + torch.tensor([0.0, 0.0, 2.3e-4]), want)
    assert tally.bad["gradients"] == 0


def test_the_models_own_rounding_error_is_allowed_and_named_where_it_is_most_of_a_tensor():
    """A program as far from the fp32 reference as 5 x the reference's own error against
    float64 passes; a wrongly scaled gradient still fails when the reference's error is that
    of fp32; a tensor the reference's error is 10 % or more of is listed."""
    from parallelizer.runtime.verify import within
    want = torch.tensor([3e-4, -2e-4, 1e-4])
    assert not within(want + 5e-5, want, 1e-5, 1e-5)
    assert within(want + 5e-5, want, 1e-5, 1e-5, noise=1e-5)
    good = torch.tensor([2.0, -1.5, 0.5])
    assert not within(good * 2, good, 1e-5, 1e-5, noise=2.4e-7)
    tally = _Tally(1e-5, 1e-5)
    tally.add("gradients", "cls_token", want + 5e-5, want, noise=3e-4)
    tally.add("gradients", "fc.weight", good, good, noise=2.4e-7)
    assert tally.bad["gradients"] == 0 and list(tally.noisy) == ["gradient cls_token"]


def _worst_rank(rank: int, port: int, found) -> None:
    import os
    import torch.distributed as dist
    from parallelizer.runtime.verify import _worst_over_ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tally = _Tally(1e-5, 1e-5)
        tally.add("gradients", f"w{rank}", torch.ones(2) + 0.1 * (rank + 1), torch.ones(2))
        if rank == 1:  # a pipeline's outputs live on its last stage only
            tally.add("outputs", "output.0", torch.ones(2) + 0.5, torch.ones(2))
        found[rank] = _worst_over_ranks(tally)
    finally:
        dist.destroy_process_group()


def test_the_worst_tensor_is_named_from_the_rank_that_has_it():
    """At pp2 the outputs are compared on the last stage only: the summary printed rank 0's
    (empty) worst, "-". It names the rank with the largest error and its tensor."""
    import socket
    import torch.multiprocessing as mp
    import warm
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = warm.context().Manager().dict()
    mp.start_processes(_worst_rank, args=(port, found), nprocs=2, start_method="forkserver")
    for rank in (0, 1):
        assert found[rank]["outputs"] == (1, "output.0")
        assert found[rank]["gradients"] == (1, "w1")
