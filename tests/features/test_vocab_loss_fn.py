"""loss_fn on vocab_parallel logits (runtime/vocab_loss.py ``VocabOutputs``,
runtime/loss_parallel_guard.py): the logits reach it as a DTensor ``Shard(-1)`` under torch's
``loss_parallel``, the other outputs as ``Replicate`` DTensors; a loss_fn DTensor cannot run,
or whose backward loss_parallel would get wrong, gets them gathered, once warned. One rank of
a real gloo group."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def vocab_outputs():
    """A :class:`VocabOutputs` for 7-column logits on a one-rank gloo group: builds a
    fresh one per call (``make()``), the group destroyed after the test."""
    import types
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parallelizer.runtime.vocab_loss import VocabOutputs
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    try:
        yield lambda: VocabOutputs(types.SimpleNamespace(vocab_outputs=((0, 7),)), mesh)
    finally:
        dist.destroy_process_group()


def test_loss_fn_failing_on_a_dtensor_gets_gathered_logits_once_warned(vocab_outputs, capsys):
    """run.py hands loss_fn the vocab-sharded logits as a DTensor; a loss_fn DTensor cannot
    run (it mixes them with a plain tensor) gets them gathered from then on, with one
    warning and the same loss; an out-of-memory error is raised, not taken for that."""
    outs = vocab_outputs()
    logits = torch.randn(2, 3, 7)
    target = torch.randint(0, 7, (2, 3))

    def mixing(out, t):  # DTensor * torch.Tensor: refused by DTensor
        return F.cross_entropy((out[0] * torch.ones(out[0].shape)).reshape(-1, 7), t.reshape(-1))

    want = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1))
    with outs.context():
        got = outs.loss(mixing, [logits], lambda flat: flat, target)
    assert not outs.sharded and torch.equal(got, want)
    assert capsys.readouterr().out.count("warning: loss_fn failed on the vocab_parallel logits") == 1

    def oom(out, t):
        raise torch.OutOfMemoryError("out of memory")

    fresh = vocab_outputs()
    with pytest.raises(torch.OutOfMemoryError):
        fresh.loss(oom, [logits], lambda flat: flat, target)
    assert fresh.sharded


def test_loss_fn_adding_a_plain_output_to_the_vocab_loss_backpropagates(vocab_outputs):
    """A model returning (logits, aux) with ``loss = cross_entropy(logits) + 0.01 * aux``: the
    DTensor loss took the plain aux in the forward and crashed in the backward ("got mixed
    torch.Tensor and DTensor", a break test, every layout). The other outputs reach loss_fn
    as Replicate DTensors now: the loss and the gradients of both outputs equal eager's,
    with the logits still sharded (no fallback)."""
    outs = vocab_outputs()
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 3, 5, generator=g), torch.randn(7, 5, generator=g)
    target = torch.randint(0, 7, (2, 3), generator=g)

    def loss_fn(out, t):
        logits, aux = out
        return F.cross_entropy(logits.reshape(-1, 7), t.reshape(-1)) + 0.01 * aux

    def grads(run):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        flat = [hh @ ww.T, (hh * hh).mean()]  # logits and an aux of the same activations
        loss = run(flat)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    want = grads(lambda flat: loss_fn(flat, target))
    with outs.context():
        got = grads(lambda flat: outs.loss(loss_fn, flat, lambda f: f, target))
    assert outs.sharded
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _entropy_bonus(logits, t):
    return F.cross_entropy(logits, t) + 0.1 * (
        logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _distilled(logits, t):
    teacher = (0.5 * logits.detach()).softmax(-1)  # a second model's, in a real one
    return F.cross_entropy(logits, t) + F.kl_div(logits.log_softmax(-1), teacher,
                                                 reduction="batchmean")


def _own_log_probs(logits, t):
    return F.nll_loss(logits - logits.logsumexp(-1, keepdim=True), t)


def _z_loss(logits, t):
    return F.cross_entropy(logits, t) + 1e-2 * logits.logsumexp(-1).pow(2).mean()


def _nll_of_a_view(logits, t):
    return F.nll_loss(F.log_softmax(logits, -1).view(2, 3, 7).transpose(1, 2), t.view(2, 3))


@pytest.mark.parametrize("loss_of, sharded", [
    (F.cross_entropy, True), (_z_loss, True), (_nll_of_a_view, True),
    (_entropy_bonus, False), (_distilled, False), (_own_log_probs, False)])
def test_loss_fn_gradients_equal_eager_whatever_reads_the_log_softmax(
        vocab_outputs, capsys, loss_of, sharded):
    """torch's loss_parallel fuses log_softmax's backward into nll_loss's (log_softmax's own
    is the identity under it): an entropy bonus read the log_softmax too and its logits'
    gradient was silently wrong (a break test at tp2: --verify FAIL, loss exact). Such a
    loss_fn gets the logits gathered, found on its autograd graph before the backward;
    cross-entropy, a z-loss beside it and nll_loss of a moved log_softmax stay sharded."""
    outs = vocab_outputs()
    g = torch.Generator().manual_seed(5)
    h, target = torch.randn(6, 7, generator=g), torch.randint(0, 7, (6,), generator=g)

    def loss_fn(out, t):
        return loss_of(out[0], t)

    def grad(run):
        hh = h.clone().requires_grad_()
        loss = run([hh * 1.0])
        return loss.detach(), torch.autograd.grad(loss, hh)[0]

    want = grad(lambda flat: loss_fn(flat, target))
    with outs.context():
        got = grad(lambda flat: outs.loss(loss_fn, flat, lambda f: f, target))
    assert outs.sharded is sharded
    assert ("loss_fn's backward under torch's loss_parallel would be wrong" in
            capsys.readouterr().out) is not sharded
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
