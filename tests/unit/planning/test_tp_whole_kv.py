"""GQA kv heads fewer than tp, met by an op over the whole k projection (OLMo-2's k_norm, an
RMS norm over all kv heads x head_dim): no rank can hold a copy of one kv head through that
norm, so k_proj is computed whole on every rank and attention cuts each rank's copy of the kv
head its query heads read (``scatter_copies``; backward sums the copies' gradients). q, v and
the output projection stay sharded, where attention used to be replicated whole. Each rank
equals the unmodified model (outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.plan.layouts import Fused, ReplicatedHeads
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime.tp import scatter_copies_to_tp_region

from tp_check import assert_tp_matches, planned
from tp_small_models import H, captured, tiny_lm, x_batch

HEADS, KV, D = 4, 2, 8


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm, as OLMo-2 writes it: mean, rsqrt, multiply (not aten.rms_norm)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class WholeKNorm(nn.Module):
    """q per head, k RMS-normed over its whole projection (KV x D features) before its view
    into heads, v plain; SDPA with enable_gqa; then an MLP (column, row). ``fused``: the norm
    is torch's ``nn.RMSNorm`` (one aten.rms_norm) instead of OLMo-2's mean / rsqrt / mul."""

    def __init__(self, fused=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, KV * D), nn.Linear(H, KV * D)
        self.k_norm = nn.RMSNorm(KV * D) if fused else RMSNorm(KV * D)
        self.o = nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, D).transpose(1, 2)
        k = self.k_norm(self.k(x)).view(b, t, KV, D).transpose(1, 2)
        v = self.v(x).view(b, t, KV, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(x)))


def _planned(tp, fused=False):
    torch.manual_seed(0)
    model = WholeKNorm(fused)
    cap = captured(model, x_batch())
    decision = plan_tp(cap.gm.graph, tp)
    apply_cleanup(cap.gm)
    apply_tensor_parallel(cap.gm, decision)
    return model, cap, decision


def _attention_sharded(d):
    assert {"q.weight", "v.weight", "up.weight"} <= d.column
    assert {"o.weight", "down.weight"} <= d.row
    assert d.layouts["v.weight"].kind == "replicated_heads"
    (cut,) = [r for r in d.redistributions if r.kind == "scatter_copies"]
    assert cut.dim == 1 and "scaled_dot_product_attention" in cut.readers[0]


def test_k_kept_whole_and_cut_to_copies_at_tp_above_kv_heads():
    """The norm's mean is all-reduced (DTensor's Partial, cheaper than a gather), which
    leaves k evenly split (4 of 16 features a rank at tp 4): no view into 2 heads. Main
    before: the whole attention (q, k, v, o) replicated."""
    model, cap, d = _planned(4)
    assert "k.weight" not in d.column and "k.weight" not in d.row
    _attention_sharded(d)
    assert any(line.startswith("kept whole: k.weight") for line in d.report)
    assert_tp_matches(model, x_batch(), 4, d, cap.gm)


def test_fused_norm_gathers_k_then_cuts_its_copies():
    """One aten.rms_norm: DTensor gathers its input, so k_proj stays sharded and its normed
    output is whole, then cut to each rank's copy at attention."""
    model, cap, d = _planned(4, fused=True)
    assert "k.weight" in d.column
    _attention_sharded(d)
    assert any(r.kind == "all_gather" for r in d.redistributions)
    assert_tp_matches(model, x_batch(), 4, d, cap.gm)


def test_tp_dividing_the_kv_heads_shards_k_as_before():
    model, cap, d = _planned(2)
    assert {"q.weight", "k.weight", "v.weight"} <= d.column
    assert not [r for r in d.redistributions if r.kind == "scatter_copies"]
    assert_tp_matches(model, x_batch(), 2, d, cap.gm)


@pytest.mark.parametrize("tp, kv", [(4, 2), (4, 1), (2, 1)])
def test_scatter_copies_forward_and_backward(tp, kv):
    """The runtime operator on real threads of ranks (emit/tp_threads.py's exchange): rank r
    holds entry r // (tp / kv); the gradient of each entry is the sum of its copies'."""
    from parallelizer.emit.tp_threads import rank_threads, run_ranks
    x = torch.randn(2, kv, 3, 4)
    weights = [torch.randn(2, 1, 3, 4) for _ in range(tp)]

    def rank(r):
        xr = x.clone().requires_grad_()
        y = scatter_copies_to_tp_region(xr, 1)
        (y * weights[r]).sum().backward()
        return y.detach(), xr.grad
    with rank_threads(tp) as ex:
        outs, grads = zip(*run_ranks(ex, rank))
    copies = tp // kv
    for r in range(tp):
        torch.testing.assert_close(outs[r], x[:, r // copies:r // copies + 1], rtol=0, atol=0)
    want = torch.cat([sum(weights[h * copies:(h + 1) * copies]) for h in range(kv)], dim=1)
    for r in range(tp):
        torch.testing.assert_close(grads[r], want)


class _CountingTransport:
    """A shape-faithful tp rank (runtime/tp.py ShapeTransport) counting the bytes it would
    send: a ring all-gather sends tp - 1 times the rank's piece, an all-reduce twice
    (tp - 1) / tp of the tensor."""

    def __init__(self, tp):
        from parallelizer.runtime.tp import ShapeTransport
        self.inner, self.tp, self.sent = ShapeTransport(tp), tp, 0

    def size(self):
        return self.tp

    def rank(self):
        return 0

    def all_gather(self, t):
        self.sent += (self.tp - 1) * t.numel() * t.element_size()
        return self.inner.all_gather(t)

    def all_reduce(self, t, op="sum"):
        self.sent += 2 * (self.tp - 1) * t.numel() * t.element_size() // self.tp
        return self.inner.all_reduce(t, op)


def test_scatter_copies_bytes_are_what_the_runtime_sends():
    """report.md's bytes of a ``scatter_copies`` are what scatter_copies_to_tp_region sends
    per step: its backward all-gathers each rank's copy, one of the kv heads (1/kv of the
    value), not a 1/tp block (main before: 1/2 of it at tp 4 over 2 kv heads)."""
    from parallelizer.runtime.tp import using_transport
    tp = 4
    _model, cap, d = _planned(tp)
    (cut,) = [r for r in d.redistributions if r.kind == "scatter_copies"]
    producer = next(n for n in cap.gm.graph.nodes if n.name == cut.producer)
    val = producer.meta["val"]
    sizes = [s.node.hint if isinstance(s, torch.SymInt) else s for s in val.shape]
    x = torch.randn(*sizes, dtype=val.dtype, requires_grad=True)
    counting = _CountingTransport(tp)
    with using_transport(counting):
        scatter_copies_to_tp_region(x, cut.dim).sum().backward()
    assert counting.sent == cut.bytes == (tp - 1) * x.numel() // KV * x.element_size()


class SlicedQKV(nn.Module):
    """Phi-3's block: one q|k|v projection sliced into q (4 heads) and k, v (2 kv heads
    each), SDPA with enable_gqa; then an MLP."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, H + 2 * KV * D, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q = qkv[..., :H].view(b, t, HEADS, D).transpose(1, 2)
        k = qkv[..., H:H + KV * D].view(b, t, KV, D).transpose(1, 2)
        v = qkv[..., H + KV * D:].view(b, t, KV, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(x)))


class SplitQKV(SlicedQKV):
    """The same projection (with a bias) cut by ``split([q, k, v], dim=-1)``, each part
    viewed with -1 heads: the split sees the parts' head_dim in those views
    (cuts.py _view_unit)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, H + 2 * KV * D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([H, KV * D, KV * D], dim=-1)
        q, k, v = (p.view(b, t, -1, D).transpose(1, 2) for p in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("cut", ["slices", "split"])
def test_sliced_qkv_at_tp_above_kv_heads_copies_the_kv_parts(cut):
    """Main before 5f10b1c: "mesh.tp (4) must divide the number of heads (2)", though 4 is a
    multiple of the kv heads; then the fused projection was computed whole on every rank
    and attention with it. Now the views of the slices into heads give the parts' head_dim,
    so the k and v parts (2 kv heads each) are laid out as copies inside the fused layout
    (cuts.py sliced_heads, as Falcon's multi-query cuts): qkv is column_parallel, attention
    runs on each rank's heads, and nothing is redistributed. ``split``: the same projection
    with a bias, cut by ``split([q, k, v])`` (SplitQKV), its bias laid out alike."""
    torch.manual_seed(0)
    model = SlicedQKV() if cut == "slices" else SplitQKV()
    gm, d = planned(model, x_batch(), 4)
    assert {"qkv.weight", "up.weight"} == d.column and {"o.weight", "down.weight"} == d.row
    copies = ReplicatedHeads(KV, D)
    layout = Fused((H, KV * D, KV * D), (None, copies, copies))
    assert d.layouts["qkv.weight"] == layout
    if cut == "split":
        assert d.layouts["qkv.bias"] == layout
    assert d.redistributions == []
    assert_tp_matches(model, x_batch(), 4, d, gm)


@pytest.mark.parametrize("tp", [2, 4])
def test_transformers_phi3_sliced_qkv_shards_at_every_tp(tp):
    """transformers' Phi-3 (its qkv_proj sliced, each slice viewed with -1 heads) at tp 2
    (the kv heads split) and tp 4 (copied); each rank equals the model."""
    model = tiny_lm(
        "Phi3",
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV, use_cache=False, pad_token_id=0,
        tie_word_embeddings=False)
    batch = (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),)
    gm, d = planned(model, batch, tp)
    assert {f"lm.model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)} <= d.column
    assert d.redistributions == []
    assert_tp_matches(model, batch, tp, d, gm)
