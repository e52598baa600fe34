"""The eager_attention pass (parallelizer/passes/attention.py): a mask proven causal becomes
SDPA's ``is_causal`` (one proven True everywhere goes), kv heads repeated by unsqueeze +
expand + reshape become ``enable_gqa``;
the graph computes the same values, alone and under tensor parallelism (ranks in lockstep).
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

pytest.importorskip("transformers")

from parallelizer.analysis.index_algebra import element_formula, is_causal_formula  # noqa: E402
from parallelizer.frontend.capture import capture  # noqa: E402
from parallelizer.passes.attention import SDPA, apply_eager_attention  # noqa: E402
from parallelizer.passes.cleanup import apply_cleanup  # noqa: E402
from parallelizer.passes.tensor_parallel import apply_tensor_parallel  # noqa: E402
from parallelizer.planning.tp import plan_tp  # noqa: E402

from test_tp_zoo import LR, TOL, _call, _loss, _reference, block_matrices  # noqa: E402
from tp_lockstep import local, run_ranks  # noqa: E402
from tp_zoo_models import EXAMPLES, ZOO  # noqa: E402

aten = torch.ops.aten


def _sdpas(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _mask(n):
    return n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")


_CAPTURED = {}  # name -> (model, batch, Captured): one capture per family in this module


def _captured(name, batch=None):
    """The family's model, batch and capture; the graph is a fresh copy for each caller."""
    key = (name, batch is None)
    if key not in _CAPTURED:
        model, batch_of, _ = {**ZOO, **EXAMPLES}[name]()
        model.train()
        b = batch or batch_of()
        _CAPTURED[key] = model, b, capture(model, b, Path(name))
    model, b, cap = _CAPTURED[key]
    return model, b, dataclasses.replace(cap, gm=copy.deepcopy(cap.gm))


def _assert_same_outputs(model, cap, batch):
    flat = [batch[n] for n in cap.input_names]
    got, _ = tree_flatten(cap.gm(*flat))
    want, _ = tree_flatten(_call(model, batch))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["example_llama", "mistral"])
def test_causal_mask_and_repeat_kv_become_sdpa_flags(name):
    model, batch, cap = _captured(name)
    before = len(cap.gm.graph.nodes)
    assert all(_mask(n) is not None for n in _sdpas(cap.gm))
    assert apply_eager_attention(cap.gm)
    for n in _sdpas(cap.gm):
        assert _mask(n) is None and n.kwargs["is_causal"] and n.kwargs["enable_gqa"], n.format_node()
        assert n.args[1].target is not aten.reshape.default  # k read unrepeated
    # the mask chain and both repeats are gone: no expand to 5-D, no boolean tensor left
    assert not [n for n in cap.gm.graph.nodes if n.target is aten.expand.default
                and len(n.meta["val"].shape) == 5]
    assert not [n for n in cap.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].dtype == torch.bool]
    assert len(cap.gm.graph.nodes) < before
    _assert_same_outputs(model, cap, batch)


def test_padding_attention_mask_is_not_causal():
    """A mask read from the attention_mask input depends on data: kept (the kv repeat, a pure
    relabelling, still becomes enable_gqa)."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0  # left padding
    model, batch, cap = _captured("mistral", {"input_ids": ids, "attention_mask": am})
    apply_eager_attention(cap.gm)
    for n in _sdpas(cap.gm):
        assert _mask(n) is not None and not n.kwargs.get("is_causal"), n.format_node()
        assert element_formula(_mask(n)) is None
    _assert_same_outputs(model, cap, batch)


def test_sliding_window_mask_is_not_causal():
    import transformers as T
    cfg = T.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          sliding_window=3, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = T.MistralForCausalLM(cfg).train()
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    cap = capture(model, batch, Path("mistral_sliding"))
    (n,) = _sdpas(cap.gm)
    f = element_formula(_mask(n))
    assert f is not None and not is_causal_formula(f)  # proven a formula, not k <= q
    apply_eager_attention(cap.gm)
    assert _mask(n) is not None and not n.kwargs.get("is_causal")
    _assert_same_outputs(model, cap, batch)


class HandWrittenAttention(torch.nn.Module):
    """Attention as a user writes it: 4 query heads, 2 kv heads repeated by indexing +
    expand + reshape, a boolean mask built one of several ways."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask = mask
        self.q, self.k, self.v = (torch.nn.Linear(16, n) for n in (16, 8, 8))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 4).transpose(1, 2)[:, :, None].expand(b, 2, 2, t, 4)
                .reshape(b, 4, t, 4) for p in (self.k, self.v))
        i, ones = torch.arange(t), torch.ones(t, t, dtype=torch.bool)
        mask = {"le": i[None, :] <= i[:, None], "tril": ones.tril(), "not_triu": ~ones.triu(1),
                "anti": i[None, :] >= i[:, None], "window": (i[None, :] <= i[:, None]) &
                (i[None, :] > i[:, None] - 2), "tril_shifted": ones.tril(1),
                "everywhere": i[None, :] >= 0,
                # a bool compared with an int: torch reads True as 1 (still the causal mask)
                "le_ne_0": (i[None, :] <= i[:, None]) != 0,
                "le_eq_1": (i[None, :] <= i[:, None]) == 1,
                "not_le_eq_0": ~((i[None, :] <= i[:, None]) == 0)}[self.mask]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how,kind", [("le", "causal"), ("tril", "causal"), ("not_triu", "causal"),
                                      ("everywhere", "all"), ("anti", None), ("window", None),
                                      ("tril_shifted", None)])
def test_hand_written_masks(how, kind):
    """The proof reads the ops, whatever builds the mask: k <= q for every size becomes
    is_causal, True everywhere becomes no mask, anything else stays."""
    torch.manual_seed(0)
    model = HandWrittenAttention(how)
    batch = {"x": torch.randn(2, 6, 16)}
    cap = capture(model, batch, Path(how))
    assert apply_eager_attention(cap.gm)  # the kv repeat at least
    (n,) = _sdpas(cap.gm)
    assert n.kwargs["enable_gqa"] and (_mask(n) is None) == (kind is not None), n.format_node()
    assert bool(n.kwargs.get("is_causal")) == (kind == "causal")
    _assert_same_outputs(model, cap, batch)


@pytest.mark.parametrize("how", ["le_ne_0", "le_eq_1", "not_le_eq_0"])
def test_bool_compared_with_int_is_never_taken_for_all_true(how):
    """``causal != 0`` is the causal mask (torch: True == 1): it may become is_causal or stay,
    never be dropped as True everywhere (sympy alone answers Ne(i <= j, 0) = True)."""
    torch.manual_seed(0)
    model = HandWrittenAttention(how)
    batch = {"x": torch.randn(2, 6, 16)}
    cap = capture(model, batch, Path(how))
    apply_eager_attention(cap.gm)
    (n,) = _sdpas(cap.gm)
    assert _mask(n) is not None or n.kwargs.get("is_causal"), n.format_node()
    _assert_same_outputs(model, cap, batch)


def test_encoder_mask_without_padding_is_dropped():
    """RoBERTa without an attention_mask input: its bidirectional mask is True everywhere."""
    model, batch, cap = _captured("roberta")
    assert all(_mask(n) is not None for n in _sdpas(cap.gm))
    assert apply_eager_attention(cap.gm)
    assert all(_mask(n) is None and not n.kwargs.get("is_causal") for n in _sdpas(cap.gm))
    _assert_same_outputs(model, cap, batch)


@pytest.mark.parametrize("name,tp", [("example_llama", 2), ("example_llama", 4), ("gemma", 2)])
def test_rewritten_attention_shards_and_matches_under_tp(name, tp):
    """The planner reads SDPA's enable_gqa as it reads repeat_kv: kv heads split at tp=2, a kv
    copy per rank when tp > kv heads (Llama tp=4: 2 kv heads; Gemma: 1)."""
    model, batch, cap = _captured(name)
    gm = cap.gm
    apply_eager_attention(gm)
    d = plan_tp(gm.graph, tp)
    mats = block_matrices(model)
    assert [m for m in mats if m not in d.dims] == [], d.report
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    ref_outs, ref_grads, ref_stepped = _reference(model, batch)
    flat = [batch[n] for n in cap.input_names]
    for r, res in enumerate(run_ranks(gm, d, tp, flat, _loss, LR)):
        for out, ref in zip(res.outputs, ref_outs):
            torch.testing.assert_close(out, ref, **TOL)
        for fqn, grad in ref_grads.items():
            if fqn in res.grads:
                torch.testing.assert_close(res.grads[fqn], local(grad, fqn, d, tp, r), **TOL)
                torch.testing.assert_close(res.params[fqn], local(ref_stepped[fqn], fqn, d, tp, r),
                                           **TOL)
