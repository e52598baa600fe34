"""Activation checkpointing and buffers the forward writes (passes/recompute_writes.py,
runtime/recompute.py): a checkpointed block's recompute ran BatchNorm again and updated its
running statistics and ``num_batches_tracked`` twice per step, silently (a break test: 6
after 3 steps, ``--verify`` passing). The real ``torch.utils.checkpoint`` with the runtime's
own context function."""
from __future__ import annotations

import copy
import functools

import torch
from torch.utils.checkpoint import checkpoint

from parallelizer.passes.recompute_writes import apply_recompute_writes
from parallelizer.runtime import recompute
from parallelizer.runtime.stage_builder import checkpoint_contexts
from tp_small_models import ConvBN, captured


def _x(seed):
    return torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(seed))


def _steps(module, n=3):
    for seed in range(n):
        out = module(_x(seed))
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.square().sum().backward()
    return out


def _checkpointed(gm):
    gm.forward = functools.partial(checkpoint, gm.forward, use_reentrant=False,
                                   context_fn=checkpoint_contexts)
    return gm


def test_a_checkpointed_batch_norm_updates_its_statistics_once_per_step():
    torch.manual_seed(0)
    model = ConvBN()
    eager = copy.deepcopy(model)
    gm = captured(model, (_x(0),)).gm
    assert apply_recompute_writes(gm, "full")
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {recompute.batch_norm, recompute.write_once} <= targets
    got = _steps(_checkpointed(gm))
    want = _steps(eager)
    assert int(gm.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 3
    torch.testing.assert_close(gm.bn.running_mean, eager.bn.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(gm.bn.running_var, eager.bn.running_var, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gm.conv.weight.grad, eager.conv.weight.grad)
    assert not recompute.recomputing()


def test_without_the_pass_the_recompute_updates_them_again():
    """What the pass is for: the captured graph checkpointed as it is counts every step twice."""
    torch.manual_seed(0)
    gm = captured(ConvBN(), (_x(0),)).gm
    _steps(_checkpointed(gm))
    assert int(gm.bn.num_batches_tracked) == 6


def test_without_activation_checkpointing_the_graph_is_left_as_it_is():
    gm = captured(ConvBN(), (_x(0),)).gm
    before = gm.code
    assert not apply_recompute_writes(gm, "none") and gm.code == before
