"""Token means (analysis/token_mean.py, planning/token_mean.py, passes/token_mean.py,
runtime/token_mean.py): a loss averaged over a count the inputs decide is divided by the whole
step's count, so the mean of the chunks' losses (dp ranks x microbatches) is the whole batch's
loss and its gradients are the whole batch's, however unevenly the ignored labels fall.

In-process: the captured graph rewritten by the pass, run on row chunks as the step runs it
(runtime/step.py), against the unmodified model on the whole batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from parallelizer.analysis.token_mean import token_mean_sites
from parallelizer.frontend.capture import capture
from parallelizer.passes.token_mean import apply_token_mean
from parallelizer.planning.token_mean import plan_token_mean, token_mean_note
from parallelizer.runtime.token_mean import counter, denominators, whole_step_counts

CHUNKS = 4


class _Loss(nn.Module):
    """A head and one of several losses over ``labels`` (-100 ignored) or a ``mask``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.head = nn.Linear(8, 16)
        if kind == "target_from_weights":
            self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, labels, mask):
        logits = self.head(x)
        flat, target = logits.flatten(0, 1), labels.flatten()
        if self.kind == "cross_entropy":
            return F.cross_entropy(flat, target)
        if self.kind == "smoothed":
            return nn.CrossEntropyLoss(label_smoothing=0.1)(flat, target)
        if self.kind == "nll":
            return F.nll_loss(F.log_softmax(flat, -1), target)
        if self.kind == "plus_scaled":
            return 0.5 * F.cross_entropy(flat, target) + logits.pow(2).mean() - 1.0
        if self.kind == "sum_over_count":  # transformers' fixed_cross_entropy's spelling
            return F.cross_entropy(flat, target, reduction="sum") / (target != -100).sum()
        if self.kind == "chunked_sum_over_count":  # the loss computed 3 positions at a time
            total = flat.new_zeros(())
            for xc, yc in zip(logits.split(3, 1), labels.split(3, 1)):
                total = total + F.cross_entropy(xc.flatten(0, 1), yc.flatten(), reduction="sum")
            return total / (labels != -100).sum()
        if self.kind == "nll_sum_over_count":
            summed = F.nll_loss(F.log_softmax(flat, -1), target, reduction="sum")
            return summed / (labels != -100).sum()
        per = F.cross_entropy(flat, target.clamp(min=0), reduction="none")
        m = mask.flatten().float()
        if self.kind == "masked":
            return (per * m).sum() / m.sum()
        if self.kind == "masked_written":  # the counter would copy ones(), not the write
            m = torch.ones_like(m)
            m[:5] = 0
            return (per * m).sum() / m.sum()
        if self.kind == "masked_clamped":  # not a sum of the chunks' counts
            return (per * m).sum() / m.sum().clamp(min=1)
        if self.kind == "perplexity":  # exp of the mean is not linear in it
            return torch.exp(F.cross_entropy(flat, target))
        if self.kind == "weighted":
            return F.cross_entropy(flat, target, weight=torch.arange(1.0, 17.0))
        if self.kind == "target_from_weights":
            return F.cross_entropy(flat, (target + self.scale.detach().long()).clamp(max=15))
        raise AssertionError(self.kind)


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 8, generator=g)
    labels = torch.randint(0, 16, (8, 6), generator=g)
    labels[0, :5] = -100  # ignored labels spread unevenly over the 4 chunks
    labels[3, :] = -100
    labels[6, 1:] = -100
    mask = (labels != -100).long()
    return x, labels, mask


def _captured(model, batch):
    return capture(model, batch, Path("model.py"))


@pytest.mark.parametrize("kind, found", [
    ("cross_entropy", "loss"), ("smoothed", "loss"), ("nll", "loss"), ("plus_scaled", "loss"),
    ("masked", "div"), ("sum_over_count", "div"), ("nll_sum_over_count", "div"),
    ("chunked_sum_over_count", "div"),
    ("masked_written", None), ("masked_clamped", None), ("perplexity", None), ("weighted", None),
    ("target_from_weights", None)])
def test_sites_are_quotients_over_input_counts_reaching_the_loss_linearly(kind, found):
    c = _captured(_Loss(kind), _batch())
    sites = token_mean_sites(c.gm.graph, c.input_names)
    assert [s.kind for s in sites] == ([found] if found else []), sites
    if found:
        assert sites[0].line.startswith("test_token_mean.py:"), sites


@pytest.mark.parametrize("kind", ["cross_entropy", "smoothed", "nll", "plus_scaled", "masked",
                                  "sum_over_count", "nll_sum_over_count", "chunked_sum_over_count"])
def test_chunks_over_the_whole_step_count_give_the_whole_batch_loss_and_gradients(kind):
    """The rewritten graph on 4 row chunks under the whole step's count: the mean of the
    chunks' losses and gradients is the whole batch's (fp32 rounding); without it (each
    chunk's own mean, what the program computed before) the loss is off by ~1e-2. A loss
    summed over the tokens and divided by the label count (``reduction="sum"``, transformers'
    ``fixed_cross_entropy``) was no token mean before: a held-out zoo's verify FAILed at pp2
    and dp2."""
    torch.manual_seed(0)
    model, batch = _Loss(kind), _batch()
    whole = model(*batch)
    whole_grads = torch.autograd.grad(whole, list(model.parameters()))
    c = _captured(model, batch)
    decision = plan_token_mean(c.gm.graph, c.input_names)
    assert apply_token_mean(c.gm, decision)
    rows = batch[0].shape[0] // CHUNKS
    chunks = [[t[i * rows:(i + 1) * rows] for t in batch] for i in range(CHUNKS)]

    def mean_over_chunks(context):
        params = list(c.gm.parameters())
        grads = [torch.zeros_like(p) for p in params]
        losses = []
        for chunk in chunks:
            with context():
                loss = c.gm(*chunk)
                loss = loss[0] if isinstance(loss, (tuple, list)) else loss
            for g, d in zip(grads, torch.autograd.grad(loss, params)):
                g += d / CHUNKS
            losses.append(loss.detach())
        return torch.stack(losses).mean(), grads

    count = counter(decision.counter)
    dens = denominators(count, chunks, CHUNKS, "cpu")
    loss, grads = mean_over_chunks(lambda: whole_step_counts(dens))
    assert torch.allclose(loss, whole, atol=1e-6, rtol=1e-6), (loss, whole)
    for got, want in zip(grads, whole_grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()
    per_chunk, _ = mean_over_chunks(nullcontext)
    assert (per_chunk - whole).abs() > 1e-3, (per_chunk, whole)


def test_one_chunk_outside_a_step_is_the_models_own_mean_bit_for_bit():
    """The compile's checks run the graph without the step's count: each chunk divides by its
    own, and on the whole batch that is torch's mean exactly."""
    model, batch = _Loss("cross_entropy"), _batch()
    c = _captured(model, batch)
    apply_token_mean(c.gm, plan_token_mean(c.gm.graph, c.input_names))
    got = c.gm(*batch)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(got, model(*batch))


def test_counter_counts_what_a_causal_lm_divides_by():
    """Hugging Face's causal-LM loss shifts and pads the labels in the graph: the counter
    copies that derivation, so it counts the shifted targets other than -100."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 7))
    labels = ids.clone()
    labels[0, :4] = -100
    batch = {"input_ids": ids, "labels": labels}
    c = _captured(LlamaForCausalLM(cfg), batch)
    decision = plan_token_mean(c.gm.graph, c.input_names)
    assert [s["kind"] for s in decision.sites] == ["loss"] and decision.exact, decision
    (n,) = counter(decision.counter)(*[batch[k] for k in c.input_names])
    assert int(n) == int((labels[:, 1:] != -100).sum()) == 3 + 6


@pytest.mark.parametrize("kind, exact", [("cross_entropy", True), ("plus_scaled", False)])
def test_the_note_says_the_loss_is_the_whole_batchs_only_when_it_is(kind, exact):
    """A loss adding another term to a token mean: the note said "the loss and its gradients
    are the whole batch's" and the warning that it is not a mean over samples, both (a break
    test); the note now says which part is."""
    c = _captured(_Loss(kind), _batch())
    decision = plan_token_mean(c.gm.graph, c.input_names)
    note = token_mean_note(decision)
    assert decision.exact is exact
    assert ("the loss and its gradients are the whole batch's" in note) is exact, note
    assert ("its other terms still average each chunk's own" in note) is not exact, note
