"""Encoder-decoders at tp 2 (issue 23, part 4): every decoder block's cross-attention
projects the one encoder output. Under sequence parallelism that output is all-gathered for
the k/v linears reading it, and the all-gather was fused with the linears of *every*
decoder block into one node sitting in the first block: the blocks interleaved, split_blocks
outlined none of them and the compile raised SplitMismatch (an internal error) for T5 and
for BART (learned positions). Now each block fuses its own readers.

Numerics: the tp- and sequence-parallel-rewritten graph runs as tp ranks in lockstep in one
process (tests/tp_lockstep.py); outputs, every gradient and the parameters after an SGD
step equal the unmodified transformers model's (fp32, 1e-5)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten
from transformers import (BartConfig, BartForConditionalGeneration, T5Config,
                          T5ForConditionalGeneration)

from parallelizer.analysis.graph_facts import block_of
from parallelizer.frontend.capture import capture
from parallelizer.passes.cleanup import apply_cleanup
from parallelizer.passes.sequence_parallel import apply_sequence_parallel
from parallelizer.passes.split_blocks import split_blocks
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.blocks import find_blocks
from parallelizer.planning.sequence import plan_sequence_parallel
from parallelizer.planning.tp import plan_tp
from parallelizer.runtime import sequence as sp
from tp_check import weighted_loss
from tp_lockstep import local, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1
VOCAB = 64


def t5():
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
        pad_token_id=0))


def bart():
    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, use_cache=False))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (3, 8), generator=g),
            "labels": torch.randint(3, VOCAB, (3, 8), generator=g)}


@pytest.mark.parametrize("build", [t5, bart])
@pytest.mark.parametrize("mode", ["auto", "false"])
def test_encoder_decoder_tp2_matches_and_outlines_every_block(build, mode):
    model, tp = build(), 2
    model.train()
    blocks = find_blocks(model)
    cap = capture(model, batch(1), Path("encdec"))
    gm = cap.gm
    d = plan_tp(gm.graph, tp)
    assert any(f.endswith("EncDecAttention.k.weight") or f.endswith("encoder_attn.k_proj.weight")
               for f in d.column), sorted(d.column)
    apply_cleanup(gm)
    apply_tensor_parallel(gm, d)
    s = plan_sequence_parallel(gm.graph, tp, mode, d.placements, blocks=blocks)
    apply_sequence_parallel(gm, s)
    assert s.enabled == (mode == "auto"), s.report
    fused = [n for n in gm.graph.nodes if n.target is sp.gathered_linears]
    assert bool(fused) == s.enabled
    for n in fused:  # each fused all-gather serves the linears of one block
        owners = {block_of(u, blocks) for u in n.users}
        assert owners == {block_of(n, blocks)}, (n.name, owners)

    data = batch(2)
    ref = copy.deepcopy(model)
    want_outs, _ = tree_flatten(ref(**data))
    weighted_loss(want_outs).backward()
    ranks = run_ranks(gm, d, tp, [data[n] for n in cap.input_names], weighted_loss, LR)
    named = list(ref.named_parameters(remove_duplicate=False))
    for r, res in enumerate(ranks):
        for got, want in zip(res.outputs, want_outs):
            torch.testing.assert_close(got, want, **TOL)
        checked = 0
        for fqn, p in named:
            if fqn not in res.grads:
                continue
            checked += 1
            torch.testing.assert_close(res.grads[fqn], local(p.grad, fqn, d, tp, r), **TOL,
                                       msg=lambda m: f"rank {r} {fqn}: {m}")
            stepped = local(p.detach() - LR * p.grad, fqn, d, tp, r)
            torch.testing.assert_close(res.params[fqn], stepped, **TOL,
                                       msg=lambda m: f"rank {r} {fqn}: {m}")
        assert checked >= len({id(p) for _, p in named}) - 1, checked

    found, notes = split_blocks(gm.graph, blocks)
    assert [b.fqn for b in found] == list(blocks), notes
