"""torch's cross-attention under tensor parallelism: a column weight read in static pieces,
each by its own linear (analysis/sharding/pieces.py).

``nn.MultiheadAttention(q, kv, kv)`` (kv not q) reads ``w_q, w_kv = in_proj_weight.split([E,
2E])`` and the bias alike, then ``unflatten(-1, (2, E))``s the kv projection; with ``kdim`` /
``vdim`` it keeps q/k/v weights of their own and reads ``in_proj_bias.chunk(3)``.
``nn.TransformerDecoderLayer``'s ``multihead_attn`` and ``nn.Transformer`` are built on it.
The in_proj becomes column parallel with a ``fused [E, E, E]`` layout (the q piece, and the
kv piece's own ``[E, E]``, side by side), the split sizes local; the compile's self-check
runs every tp rank against the model in one process. Before, these weights were not seen as
linears at all: the cross-attention stayed replicated (a model of cross-attention blocks
only was refused, "no linear layer feeds another")."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec

VOCAB, DIM, HEADS, KDIM, VDIM = 64, 32, 4, 16, 24
FUSED = {"kind": "fused", "parts": [32, 32, 32]}


class _Cross(nn.Module):
    """Pre-norm cross-attention blocks over a memory (the source embeddings); ``kdim``: the
    memory has widths of its own for k and v (``kdim``/``vdim``)."""

    def __init__(self, kdim: bool):
        super().__init__()
        self.kdim = kdim
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        extra = {"kdim": KDIM, "vdim": VDIM} if kdim else {}
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, HEADS, batch_first=True, **extra)
                                  for _ in range(2))
        self.k_emb = nn.Embedding(VOCAB, KDIM if kdim else DIM)
        self.v_emb = nn.Embedding(VOCAB, VDIM)

    def forward(self, h, src):
        k = self.k_emb(src)
        v = self.v_emb(src) if self.kdim else k
        for norm, attn in zip(self.norms, self.attn):
            h = h + attn(norm(h), k, v, need_weights=False)[0]
        return h


class _Model(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, DIM)
        if kind in ("cross_attention", "kdim_vdim"):
            self.core = _Cross(kind == "kdim_vdim")
        elif kind == "transformer_decoder":  # dropout 0.1 as torch configures it
            layer = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=64, batch_first=True)
            self.core = nn.TransformerDecoder(layer, num_layers=2)
        else:
            self.core = nn.Transformer(DIM, HEADS, num_encoder_layers=1, num_decoder_layers=1,
                                       dim_feedforward=64, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, src):
        h = self.emb(ids)
        if self.kind in ("cross_attention", "kdim_vdim"):
            return self.head(self.core(h, src))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        if self.kind == "transformer_decoder":
            return self.head(self.core(h, self.emb(src), tgt_mask=mask, tgt_is_causal=True))
        return self.head(self.core(self.emb(src), h, tgt_mask=mask, tgt_is_causal=True))


def _loss(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1))


def _compile(kind: str, tp: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, VOCAB, (4, 8), generator=g),
             torch.randint(0, VOCAB, (4, 6), generator=g))
    return compile_module(_Model(kind), batch, Spec.model_validate({"mesh": {"tp": tp}}), _loss,
                          reference=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind, matrices, packed", [
    ("cross_attention", 4, ["core.attn.{i}.in_proj_weight"]),
    ("transformer_decoder", 12, ["core.layers.{i}.self_attn.in_proj_weight",
                                 "core.layers.{i}.multihead_attn.in_proj_weight"]),
    ("transformer", 10, ["core.encoder.layers.0.self_attn.in_proj_weight",
                         "core.decoder.layers.0.multihead_attn.in_proj_weight"])])
def test_cross_attention_in_proj_is_fused_and_passes_the_self_check(kind, matrices, packed, tp):
    program = _compile(kind, tp)
    notes = "\n".join(program.notes)
    assert f"tensor parallel: {matrices} of {matrices} weight matrices in blocks sharded" in notes
    assert f"self-check: {tp} tp rank(s) of the program against the model" in notes, notes
    for fqn in {p.format(i=i) for p in packed for i in range(2)}:
        for name in (fqn, fqn.replace("in_proj_weight", "in_proj_bias")):
            t = program.plan.tensors[name]
            assert t.role == "column_parallel", name
            assert t.layout.to_json() == FUSED, name
        assert program.plan.tensors[fqn].local_shape(tp) == (96 // tp, 32)
        assert program.plan.tensors[fqn.replace("in_proj_weight", "out_proj.weight")].role \
            == "row_parallel"


@pytest.mark.parametrize("tp", [2, 4])
def test_kdim_vdim_weights_and_their_chunked_bias_are_sharded_together(tp):
    program = _compile("kdim_vdim", tp)
    notes = "\n".join(program.notes)
    assert "tensor parallel: 8 of 8 weight matrices in blocks sharded" in notes, notes
    assert f"self-check: {tp} tp rank(s)" in notes, notes
    for i in range(2):
        attn = f"core.attn.{i}"
        for part, width in (("q", DIM), ("k", KDIM), ("v", VDIM)):
            t = program.plan.tensors[f"{attn}.{part}_proj_weight"]
            assert t.role == "column_parallel" and t.layout is None
            assert t.local_shape(tp) == (DIM // tp, width)
        bias = program.plan.tensors[f"{attn}.in_proj_bias"]
        assert bias.role == "column_parallel" and bias.layout.to_json() == FUSED
        assert bias.local_shape(tp) == (96 // tp,)
        assert program.plan.tensors[f"{attn}.out_proj.weight"].role == "row_parallel"


class _InputPiece(nn.Module):
    """A weight read in pieces along its *input* features (each linear a slice of the
    columns): not a column piece, so those linears stay replicated, and correct."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.w = nn.Parameter(torch.randn(2 * DIM, 2 * DIM) * 0.1)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, src):
        h = self.emb(ids)
        both = torch.cat([h, self.emb(src).mean(1, keepdim=True).expand_as(h)], -1)
        mixed = F.linear(both[..., :DIM], self.w[:DIM, :DIM]) + F.linear(both[..., DIM:],
                                                                          self.w[:DIM, DIM:])
        h = h + mixed
        return self.head(h + self.down(F.gelu(self.up(h))))


def test_a_weight_cut_along_its_input_features_stays_replicated_and_correct():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, VOCAB, (4, 8), generator=g),
             torch.randint(0, VOCAB, (4, 6), generator=g))
    program = compile_module(_InputPiece(), batch, Spec.model_validate({"mesh": {"tp": 2}}),
                             _loss, reference=False)
    notes = "\n".join(program.notes)
    assert "self-check: 2 tp rank(s)" in notes, notes
    assert program.plan.tensors["w"].role == "replicate"
    assert program.plan.tensors["up.weight"].role == "column_parallel"
    assert program.plan.tensors["down.weight"].role == "row_parallel"


class _KvFromLinear(nn.Module):
    """kdim/vdim keys and values made by a linear before the attention, with ``add_bias_kv``
    and ``add_zero_attn`` (zoo 20 Z4): the planner pairs that linear with k_proj and v_proj
    as column -> row, which keeps the chunked in_proj_bias, and with it q_proj and
    out_proj, whole."""

    def __init__(self):
        super().__init__()
        self.kv_in = nn.Linear(2 * DIM, 48)
        self.mha = nn.MultiheadAttention(2 * DIM, HEADS, batch_first=True, kdim=48, vdim=48,
                                         add_bias_kv=True, add_zero_attn=True)

    def forward(self, x):
        kv = self.kv_in(x)
        return x + self.mha(x, kv, kv, need_weights=False)[0]


def test_a_shared_bias_names_the_role_of_the_linear_that_keeps_it_whole():
    """The reason named k_proj "the replicated linear" while the plan made it row_parallel."""
    from parallelizer.planning.tp import plan_tp
    from tp_small_models import captured
    torch.manual_seed(0)
    model = nn.Sequential(_KvFromLinear(), _KvFromLinear())
    x = torch.randn(4, 16, 2 * DIM, generator=torch.Generator().manual_seed(1))
    d = plan_tp(captured(model, (x,)).gm.graph, 2, allow_replicated=True)
    named = [m.groups() for line in d.report if line.startswith("kept replicated:")
             for m in [re.search(r"shared with the (\w+) linear (\S+)\)", line)] if m]
    assert named, d.report
    for role, weight in named:
        assert role == ("row_parallel" if weight in d.row else "replicated"), (role, weight)
