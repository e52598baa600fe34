"""vocab_parallel (Megatron-LM §3): the embedding Shard(0) with a local lookup summed over tp,
the LM head column_parallel over the vocabulary, a vocabulary tp does not divide padded.

Numerics run the tp ranks in lockstep in one process (tests/tp_lockstep.py) against the
unmodified model: outputs, every gradient and the parameters after an SGD step (fp32, 1e-5),
for a tied Llama whose vocabulary (61) neither 2 nor 4 divides, with the logits returned and
with Hugging Face's in-graph loss (``labels=``). Then the padded checkpoint round trip
(reshard, export: bit-exact) and the spec's errors.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.frontend.capture import capture
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.passes.vocab_parallel import apply_vocab_parallel
from parallelizer.plan.layouts import Padded
from parallelizer.planning.tensors import alias_map, tied_groups
from parallelizer.planning.tp import plan_tp
from parallelizer.planning.tp_matrices import tp_summary
from parallelizer.planning.vocab import plan_vocab, tp_report, vocab_summary
from parallelizer.runtime.vocab import gather_from_tp_region

from tp_lockstep import local, run_ranks

transformers = pytest.importorskip("transformers")

V = 61  # neither 2 nor 4 divides it
TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1


def tied_llama(vocab=V):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def ids(b=2, t=8, seed=0):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def planned(model, batch, tp, mode="auto"):
    cap = capture(model, batch, Path(__file__))
    gm = copy.deepcopy(cap.gm)
    d = plan_tp(gm.graph, tp)
    v = plan_vocab(gm.graph, tp, mode, alias_map(tied_groups(model)), d)
    return cap, gm, d, v


def rewrite(gm, d, v):
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    apply_vocab_parallel(gm, v)


def reference(model, batch, loss_of):
    model = copy.deepcopy(model)
    out = model(**batch)
    loss_of(out).backward()
    named = list(model.named_parameters(remove_duplicate=False))
    grads = {n: p.grad.detach().clone() for n, p in named}
    with torch.no_grad():
        stepped = {n: p - LR * p.grad for n, p in named}
    return out, grads, stepped


def assert_ranks_match(ranks, d, tp, grads, stepped):
    for r, res in enumerate(ranks):
        for fqn, got in res.grads.items():
            torch.testing.assert_close(got, local(grads[fqn], fqn, d, tp, r), **TOL,
                                       msg=lambda m: f"rank {r} {fqn}: {m}")
            torch.testing.assert_close(res.params[fqn], local(stepped[fqn], fqn, d, tp, r),
                                       **TOL, msg=lambda m: f"rank {r} {fqn}: {m}")


def _ce(logits, input_ids):
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.size(-1)),
                           input_ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("vocab, tp", [(V, 2), (V, 4), (5, 4)])
def test_padded_tied_vocab_matches_unmodified_model(vocab, tp):
    """Vocabulary 61 padded to 62 / 64: the tied table Shard(0) on every rank, logits
    gathered with the padding columns dropped; loss, outputs, gradients, SGD step equal.
    5 rows at tp 4 (padded to 8) leave rank 3 padding only, whose piece was an IndexError
    (zoo 24's 61 rows at tp 29)."""
    model = tied_llama(vocab)
    batch = {"input_ids": ids() % vocab}
    cap, gm, d, v = planned(model, batch, tp)
    padded = -(-vocab // tp) * tp
    assert v.layouts["model.embed_tokens.weight"] == Padded(padded)
    assert v.vocab == {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
    assert v.heads == {"lm_head.weight"} and v.outputs == {0: vocab}
    v.outputs.clear()  # gathered in the graph, as run.py's VocabOutputs.whole does
    rewrite(gm, d, v)
    ref, grads, stepped = reference(model, batch, lambda o: _ce(o.logits, batch["input_ids"]))
    ranks = run_ranks(gm, (d, v), tp, [batch["input_ids"]],
                      lambda outs: _ce(outs[0], batch["input_ids"]), LR)
    for res in ranks:
        assert res.outputs[0].shape == (2, 8, vocab)
        torch.testing.assert_close(res.outputs[0], ref.logits, **TOL)
    # one Parameter per rank for the tied pair, its padding rows zero, gradient zero there
    last = ranks[-1].grads["model.embed_tokens.weight"]
    assert last.shape == (padded // tp, 32)
    assert last[max(0, vocab - padded + padded // tp):].abs().sum() == 0
    assert_ranks_match(ranks, (d, v), tp, grads, stepped)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_under_sequence_parallel_matches_unmodified_model(tp):
    """Both on (the defaults): the lookup's g is a reduce-scatter along the sequence (no
    all-reduce, no slice) and the head's f an all-gather fused with the head (Korthikanti et
    al. 2022 §4.2.2); padded vocabulary 61, outputs, gradients and SGD step still equal."""
    from parallelizer.passes.sequence_parallel import apply_sequence_parallel
    from parallelizer.planning.sequence import plan_sequence_parallel
    from parallelizer.runtime import sequence as sp
    from parallelizer.runtime.tp import reduce_from_tp_region
    model = tied_llama()
    batch = {"input_ids": ids()}
    cap, gm, d, v = planned(model, batch, tp)
    v.outputs.clear()  # gathered in the graph, as run.py's VocabOutputs.whole does
    rewrite(gm, d, v)
    s = plan_sequence_parallel(gm.graph, tp, "auto", d.placements)
    apply_sequence_parallel(gm, s)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert reduce_from_tp_region not in calls, "the embedding's g should be a reduce-scatter"
    assert not s.splits and not s.exits, (s.splits, s.exits)
    assert calls.count(sp.gathered_linears) == 2 * 2 + 1  # q|k|v and gate|up per layer, head
    ref, grads, stepped = reference(model, batch, lambda o: _ce(o.logits, batch["input_ids"]))
    ranks = run_ranks(gm, (d, v), tp, [batch["input_ids"]],
                      lambda outs: _ce(outs[0], batch["input_ids"]), LR)
    for res in ranks:
        torch.testing.assert_close(res.outputs[0], ref.logits, **TOL)
    assert_ranks_match(ranks, (d, v), tp, grads, stepped)


def test_sharded_logits_output_is_this_ranks_columns():
    """A model output handed to loss_fn sharded: each rank returns its padded vocabulary
    columns (padding zero); concatenated and cut to 61 they are the model's logits."""
    model = tied_llama()
    batch = {"input_ids": ids()}
    _, gm, d, v = planned(model, batch, 4)
    rewrite(gm, d, v)
    assert not any(n.target is gather_from_tp_region for n in gm.graph.nodes)
    ranks = run_ranks(gm, (d, v), 4, [batch["input_ids"]], lambda outs: outs[0].sum(), LR)
    pieces = [r.outputs[0] for r in ranks]
    assert [p.shape[-1] for p in pieces] == [16, 16, 16, 16]
    assert pieces[-1][..., V - 64:].abs().sum() == 0
    with torch.no_grad():
        want = model(**batch).logits
    torch.testing.assert_close(torch.cat(pieces, -1)[..., :V], want, **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_in_graph_loss_with_labels_is_vocab_parallel_and_matches(tp):
    """Hugging Face's ForCausalLMLoss in the graph (``labels=``: upcast, shift, view(-1, V),
    ignore_index -100, mean): rewritten into the vocab-parallel cross-entropy, no gather of
    the logits anywhere in the graph; loss, gradients and SGD step equal the model's."""
    model = tied_llama()
    labels = ids(seed=1)
    labels[0, :3] = -100
    batch = {"input_ids": ids(), "labels": labels}
    cap, gm, d, v = planned(model, batch, tp)
    assert v.outputs == {1: V}  # (loss, logits): the logits output is handed over sharded
    assert len(v.losses) == 1 and list(v.losses.values()) == [V]
    assert not any("gathered over tp in the graph" in r for r in v.report), v.report
    rewrite(gm, d, v)
    assert not any(n.target is gather_from_tp_region for n in gm.graph.nodes)
    assert not any(n.target is torch.ops.aten.cross_entropy_loss.default for n in gm.graph.nodes)
    ref, grads, stepped = reference(model, batch, lambda o: o.loss)
    flat = [batch[n] for n in cap.input_names]
    ranks = run_ranks(gm, (d, v), tp, flat, lambda outs: outs[0], LR)
    for res in ranks:
        torch.testing.assert_close(res.outputs[0], ref.loss, **TOL)
    assert_ranks_match(ranks, (d, v), tp, grads, stepped)


@pytest.mark.parametrize("reduction", [0, 2])
def test_vocab_parallel_cross_entropy_none_and_sum(reduction):
    """The rewritten loss under reduction none and sum (Hugging Face with num_items_in_batch
    sums, then divides), padded vocabulary, ignored targets: values and logit gradients."""
    import threading
    from tp_lockstep import _AllReduce
    from parallelizer.runtime.vocab_loss import VocabParallelCrossEntropy
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g, requires_grad=True)
    target = torch.randint(0, V, (6,), generator=g)
    target[2] = -100
    ref = F.cross_entropy(logits, target, reduction=["none", "mean", "sum"][reduction])
    w = torch.randn(ref.shape, generator=g)
    (ref * w).sum().backward()
    tp, comm, out = 4, _AllReduce(4), [None] * 4
    pieces = list(torch.nn.functional.pad(logits.detach(), (0, 64 - V)).chunk(tp, -1))

    def work(r):
        x = pieces[r].clone().requires_grad_()
        y = VocabParallelCrossEntropy.apply(x, target, V, -100, reduction, r,
                                            lambda t, op: comm.reduce(r, t, op))
        (y * w).sum().backward()
        out[r] = (y.detach(), x.grad)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for y, _ in out:
        torch.testing.assert_close(y, ref.detach(), **TOL)
    grad = torch.cat([gr for _, gr in out], -1)
    torch.testing.assert_close(grad[:, :V], logits.grad, **TOL)
    assert grad[:, V:].abs().sum() == 0


def test_summary_counts_the_vocabulary():
    """The summary's share of sharded parameters includes the vocabulary table."""
    model = tied_llama()
    batch = {"input_ids": ids()}
    _, gm, d, v = planned(model, batch, 2)
    _, _, off, off_v = planned(model, batch, 2, mode=False)
    pct = lambda dec, voc: int(tp_summary(dec, model, voc).split("(")[1].split(" %")[0])  # noqa: E731
    assert pct(off, off_v) < pct(d, v)
    assert "model.embed_tokens.weight" in v.dims and "model.embed_tokens.weight" not in off_v.dims
    assert "model.embed_tokens.weight" not in off.dims
    assert any("vocab_parallel: off (tensor_parallel.vocab_parallel=false)" in r for r in off_v.report)


class NormedHead(nn.Module):
    """Reads the embedding table through a norm of it, ``x @ normalize(W).T`` (no nn.Linear
    head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, input_ids):
        h = self.down(torch.relu(self.up(self.emb(input_ids))))
        return h @ F.normalize(self.emb.weight, dim=-1).T


class MatmulTiedHead(NormedHead):
    """gemma_pytorch's tied head: the table's transpose multiplied in, ``hidden @ W.t()``
    (spelled ``how``), no nn.Linear."""

    def __init__(self, how="t"):
        super().__init__()
        self.how = how

    def forward(self, input_ids):
        h = self.down(torch.relu(self.up(self.emb(input_ids))))
        w = self.emb.weight
        wt = {"t": lambda: w.t(), "T": lambda: w.T, "transpose": lambda: w.transpose(-1, -2),
              "permute": lambda: w.permute(1, 0)}[self.how]()
        return torch.matmul(h, wt)


@pytest.mark.parametrize("tp,how", [(2, "t"), (4, "T"), (2, "transpose"), (2, "permute")])
def test_tied_head_by_matmul_of_the_transpose_is_vocab_parallel_and_matches(tp, how):
    """``hidden @ W.t()`` is captured as ``linear(hidden, W)`` (frontend/einsum.py
    matmuls_as_linears): the tied table is sharded over the vocabulary with its head (main
    before: the transpose blocked vocab_parallel, table and head replicated)."""
    model = MatmulTiedHead(how)
    batch = {"input_ids": ids()}
    cap, gm, d, v = planned(model, batch, tp)
    assert v.vocab == {"emb.weight": V} and v.heads == {"emb.weight"}, (v.vocab, v.heads)
    assert "embedding and LM head emb.weight (one table) sharded" in vocab_summary(v)
    v.outputs.clear()
    rewrite(gm, d, v)
    ref, grads, stepped = reference(model, batch, lambda o: _ce(o, batch["input_ids"]))
    ranks = run_ranks(gm, (d, v), tp, [batch["input_ids"]],
                      lambda outs: _ce(outs[0], batch["input_ids"]), LR)
    for res in ranks:
        torch.testing.assert_close(res.outputs[0], ref, **TOL)
    assert_ranks_match(ranks, (d, v), tp, grads, stepped)


def test_true_with_a_blocker_is_a_plan_error_naming_key_and_op():
    with pytest.raises(PlanError) as info:
        planned(NormedHead(), {"input_ids": ids()}, 2, mode=True)
    msg = str(info.value)
    assert "tensor_parallel.vocab_parallel=true" in msg and "emb.weight" in msg, msg
    assert "test_vocab_parallel.py:" in msg and "vocab_parallel=auto" in msg, msg


def test_auto_with_a_blocker_reports_why_and_stays_replicated():
    _, _, d, v = planned(NormedHead(), {"input_ids": ids()}, 2)
    assert not v.vocab and "emb.weight" not in d.dims and "emb.weight" not in v.dims
    assert any(r.startswith("vocab_parallel: off (") and "emb.weight" in r for r in v.report)


class FusedQKVLM(nn.Module):
    """Phi-3's attention (one q|k|v projection sliced into 4 query heads and 2 kv heads of 8)
    whose q|k|v weight has the untied LM head's shape (64 x 32, a 64-row vocabulary); at
    tp 4 its 2 kv heads are copies. ``cache``: the block's k is returned too."""

    def __init__(self, cache=False):
        super().__init__()
        torch.manual_seed(0)
        self.cache = cache
        self.emb = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 64, bias=False)
        self.o = nn.Linear(32, 32, bias=False)
        self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q = qkv[..., :32].view(b, t, 4, 8).transpose(1, 2)
        k = qkv[..., 32:48].view(b, t, 2, 8).transpose(1, 2)
        v = qkv[..., 48:].view(b, t, 2, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, 32))
        x = x + self.down(F.silu(self.up(x)))
        return (self.head(x), k) if self.cache else self.head(x)


def test_block_linear_of_the_head_shape_is_no_lm_head():
    """The head is the linear whose logits the model returns, not any untied linear of the
    vocabulary table's shape: the q|k|v projection is column_parallel with its kv parts
    copied (decision 75), not sharded over the "vocabulary" as a second LM head (main
    before: report 'vocab_parallel LM head: head.weight, qkv.weight'). Ranks equal the
    unmodified model."""
    tp, b = 4, {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    model = FusedQKVLM()
    cap, gm, d, v = planned(model, b, tp)
    assert v.heads == {"head.weight"} and sorted(v.vocab) == ["emb.weight", "head.weight"]
    counts = tp_report(d, v)[0]
    assert "qkv.weight" in d.column and "qkv.weight" not in v.vocab
    assert counts.endswith("vocab_parallel LM head: head.weight; replicated: none"), counts
    assert not any("qkv" in line for line in v.report), v.report
    v.outputs.clear()
    rewrite(gm, d, v)
    loss_of = lambda logits: _ce(logits, b["input_ids"])  # noqa: E731
    ref, grads, stepped = reference(model, b, loss_of)
    ranks = run_ranks(gm, (d, v), tp, [b["input_ids"]], lambda outs: loss_of(outs[0]), LR)
    for res in ranks:
        torch.testing.assert_close(res.outputs[0], ref, **TOL)
    assert_ranks_match(ranks, (d, v), tp, grads, stepped)


def test_linear_returned_split_into_heads_is_no_lm_head():
    """A linear of the head's shape whose output the model returns viewed into heads (a kv
    cache) is not a head either."""
    b = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    _, _, _d, v = planned(FusedQKVLM(cache=True), b, 4)
    assert v.heads == {"head.weight"}


class NoEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(x))


def test_true_without_an_embedding_is_a_plan_error():
    with pytest.raises(PlanError, match="tensor_parallel.vocab_parallel=true .* no aten.embedding"):
        planned(NoEmbedding(), (torch.randn(2, 4, 16),), 2, mode=True)


def test_padded_checkpoint_reshards_and_exports_bit_exact(tmp_path):
    """Vocabulary 1001 at tp=2: the table is written padded to 1002; reshard to tp=4 (1004),
    then tp=1, and export give back the model's tensors bit for bit."""
    from parallelizer.api import compile as compile_model
    from parallelizer.convert.export import export_hf
    from parallelizer.checkpoint.hf import load_hf_state_dict
    from parallelizer.checkpoint.reader import read_manifest
    from parallelizer.convert.reshard import reshard
    from parallelizer.frontend.spec import Spec

    model = tied_llama(vocab=1001)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    batch = {"input_ids": torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(0))}
    compile_model(model, spec, batch, reference=False).save(tmp_path / "out")
    entry = read_manifest(tmp_path / "out" / "checkpoint")["tensors"]["model.embed_tokens.weight"]
    assert entry["layout"] == {"kind": "padded", "padded_size": 1002}
    reshard(tmp_path / "out" / "checkpoint", tmp_path / "tp4", tp=4)
    entry = read_manifest(tmp_path / "tp4")["tensors"]["model.embed_tokens.weight"]
    assert entry["layout"] == {"kind": "padded", "padded_size": 1004}
    reshard(tmp_path / "tp4", tmp_path / "tp1", tp=1)
    export_hf(tmp_path / "tp1", tmp_path / "hf")
    got = load_hf_state_dict(tmp_path / "hf")
    want = model.state_dict()
    assert got["model.embed_tokens.weight"].shape == (1001, 32)
    for k, t in got.items():
        assert torch.equal(t, want[k]), k


def test_spec_value_other_than_auto_true_false_is_a_spec_error(tmp_path):
    from parallelizer.errors import SpecError
    from parallelizer.frontend.spec import load_spec
    path = tmp_path / "spec.yaml"
    path.write_text("tensor_parallel: {vocab_parallel: maybe}\n")
    with pytest.raises(SpecError, match=r"tensor_parallel.vocab_parallel must be 'auto', true or "
                                        r"false .* got 'maybe'"):
        load_spec(path)
    assert load_spec(path, ["tensor_parallel.vocab_parallel=false"]).tensor_parallel.vocab_parallel \
        is False


class TiedHeadOwnBias(nn.Module):
    """A tied table read by the head with a bias of its own (``F.linear(h, wte.weight,
    self.out_bias)``)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, 16)
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.out_bias = nn.Parameter(torch.zeros(V))

    def forward(self, input_ids):
        h = self.down(torch.relu(self.up(self.wte(input_ids))))
        return F.linear(h, self.wte.weight, self.out_bias)


def test_a_heads_own_bias_is_not_named_an_embedding():
    """The summary said "embedding out_bias and LM head wte.weight" (a break test): any
    sharded name not ending in ``.bias`` was taken for a table."""
    _, _, _, v = planned(TiedHeadOwnBias(), {"input_ids": ids()}, 2)
    assert set(v.vocab) == {"wte.weight", "out_bias"}
    assert vocab_summary(v).startswith("vocab parallel: embedding and LM head wte.weight (one "
                                       "table) sharded"), vocab_summary(v)


class DistanceTable(nn.Module):
    """Wav2Vec2-BERT's relative_key attention, cut down: features in (no token ids), a
    distance table indexed by ``arange`` differences and read per head by an einsum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.o = nn.Linear(8, 32, bias=False), nn.Linear(32, 8, bias=False)
        self.distance = nn.Embedding(15, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        pos = torch.arange(t)
        rel = self.distance((pos.view(1, -1) - pos.view(-1, 1)).clamp(-7, 7) + 7)
        scores = torch.einsum("bhld,lrd->bhlr", q, rel).softmax(-1)
        return self.o((scores @ q).transpose(1, 2).reshape(b, t, 32)).pow(2).mean()


def test_a_table_no_input_indexes_is_no_vocabulary():
    """An encoder without a head took its largest table for the vocabulary: the distance
    table, then summed over tp at each lookup and read per head, left its gradient Mixed
    (an internal error on a held-out zoo's Wav2Vec2-BERT). Only a table the model's inputs
    index is a vocabulary; here none is, and vocab_parallel is off, saying why."""
    _, _, d, v = planned(DistanceTable(), {"x": torch.randn(2, 6, 8)}, 2)
    assert not v.vocab and "distance.weight" not in v.dims
    assert v.off.startswith("vocab_parallel: off (no embedding is indexed by the model's inputs")
    assert d.column == {"q.weight"} and d.row == {"o.weight"}


class _MultiTokenLM(nn.Module):
    """DeepSeek-V3-style multi-token prediction (a held-out zoo's model): one untied LM head
    predicts token t+1 from the trunk and t+2 from an MTP module's hidden states."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.mtp, self.norm = nn.Linear(2 * d, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        h = h + self.down(F.gelu(self.up(h)))
        loss = _ce(self.head(h), input_ids)
        h2 = self.mtp(torch.cat([h[:, :-1], self.emb(input_ids[:, 1:])], -1))
        return loss + 0.3 * _ce(self.head(self.norm(h2)), input_ids[:, 1:])


def test_lm_head_applied_at_every_prediction_depth_is_vocab_parallel_and_matches():
    """An untied head read by two linears, each producing logits for its own cross-entropy,
    was kept replicated ("its weight is also read by aten.linear"); each use is now a
    vocab_parallel head, both losses on the logits' shards: loss, gradients, SGD step equal."""
    torch.manual_seed(0)
    model = _MultiTokenLM().train()
    batch = {"input_ids": ids()}
    cap, gm, d, v = planned(model, batch, 2)
    assert v.heads == {"head.weight"} and len(v.losses) == 2, v.report
    assert any(r.endswith("(logits Shard(-1), applied 2 times)") for r in v.report), v.report
    rewrite(gm, d, v)
    ref, grads, stepped = reference(model, batch, lambda o: o)
    ranks = run_ranks(gm, (d, v), 2, [batch["input_ids"]], lambda outs: outs[0], LR)
    for res in ranks:
        torch.testing.assert_close(res.outputs[0], ref, **TOL)
    assert_ranks_match(ranks, (d, v), 2, grads, stepped)
