"""torch's own attention modules under tensor parallelism: ``nn.MultiheadAttention`` (q, k
and v packed in one in_proj (3E, E), its output ``unflatten(-1, (3, E))``ed, each part
selected, and ``view(L, B * H, head_dim)``: the heads merged with the batch) and
``nn.TransformerEncoderLayer`` built on it, in user-written models (not Hugging Face), and
timm's ViT spelling of the same packing (``qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1,
4).unbind(0)``).
The in_proj becomes column parallel with a ``fused [E, E, E]`` layout (each rank its block
of q, of k and of v), out_proj row parallel; the compile's self-check runs every tp rank
against the model in one process. With a key_padding_mask (the mask expanded over the heads
keeps the global ``bsz * num_heads``, each rank cuts its heads at SDPA) and with
need_weights (the heads-outer view back to (L * B, E), the weights' mean over the heads an
all-reduce) too; with both, the mask merged with the batch for ``baddbmm`` is cut to each
rank's heads before the merge."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec

VOCAB, DIM, HEADS = 64, 32, 4


class _PreNorm(nn.Module):
    """batch_first MultiheadAttention, pre-norm, GELU MLP (torchvision's ViT block shape).
    ``padding``: a key_padding_mask (the last two keys), which torch expands over the heads
    and reshapes by the same ``bsz * num_heads`` it merges q with; ``weights``: need_weights
    (the default), torch's path without SDPA whose output is viewed (L * B, E) from
    (L, B * H, head_dim) and whose weights are averaged over the heads."""

    def __init__(self, padding=False, weights=False):
        super().__init__()
        self.padding, self.weights = padding, weights
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.ln1(x)
        pad = None
        if self.padding:
            pad = torch.zeros(x.shape[:2], dtype=torch.bool)
            pad[:, -2:] = True
        out, avg = self.attn(h, h, h, key_padding_mask=pad, need_weights=self.weights)
        x = x + out + (avg.sum(-1, keepdim=True) if self.weights else 0)
        return x + self.mlp(self.ln2(x))


class _TimmAttention(nn.Module):
    """timm's ``Attention``: one qkv linear, its output reshaped to (B, N, 3, H, D)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class _TimmBlock(_PreNorm):
    def __init__(self):
        super().__init__()
        del self.attn
        self.attn = _TimmAttention()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Model(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, DIM)
        if kind.startswith("multihead_attention"):
            self.blocks = nn.ModuleList(_PreNorm("padding" in kind, "weights" in kind)
                                        for _ in range(2))
        elif kind == "timm_attention":
            self.blocks = nn.ModuleList(_TimmBlock() for _ in range(2))
        else:  # seq-first, post-norm, ReLU, dropout 0.1 as torch configures it
            layer = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=64, dropout=0.1)
            self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        if not self.kind.startswith("transformer_encoder"):
            for block in self.blocks:
                h = block(h)
            return self.head(h)
        if self.kind == "transformer_encoder_padding":  # token 0 is padding
            return self.head(self.enc(h.transpose(0, 1), src_key_padding_mask=ids == 0).transpose(0, 1))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.enc(h.transpose(0, 1), mask=mask, is_causal=True).transpose(0, 1))


def _loss(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[0][:, 1:].reshape(-1))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind, qkv, out", [
    ("multihead_attention", "blocks.{i}.attn.in_proj_weight", "blocks.{i}.attn.out_proj.weight"),
    ("multihead_attention_padding", "blocks.{i}.attn.in_proj_weight", "blocks.{i}.attn.out_proj.weight"),
    ("multihead_attention_weights", "blocks.{i}.attn.in_proj_weight", "blocks.{i}.attn.out_proj.weight"),
    ("multihead_attention_padding_weights", "blocks.{i}.attn.in_proj_weight",
     "blocks.{i}.attn.out_proj.weight"),
    ("transformer_encoder", "enc.layers.{i}.self_attn.in_proj_weight",
     "enc.layers.{i}.self_attn.out_proj.weight"),
    ("transformer_encoder_padding", "enc.layers.{i}.self_attn.in_proj_weight",
     "enc.layers.{i}.self_attn.out_proj.weight"),
    ("timm_attention", "blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.proj.weight")])
def test_torch_attention_is_sharded_and_passes_the_self_check(kind, qkv, out, tp):
    torch.manual_seed(0)
    model = _Model(kind)
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    ids[1, -3:] = 0  # padding in one sequence (transformer_encoder_padding's mask)
    batch = (ids,)
    program = compile_module(model, batch, Spec.model_validate({"mesh": {"tp": tp}}), _loss,
                             reference=False)
    notes = "\n".join(program.notes)
    assert "tensor parallel: 8 of 8 weight matrices in blocks sharded" in notes, notes
    assert f"self-check: {tp} tp rank(s) of the program against the model" in notes, notes
    for i in range(2):
        packed = program.plan.tensors[qkv.format(i=i)]
        assert packed.role == "column_parallel"
        assert packed.layout.to_json() == {"kind": "fused", "parts": [32, 32, 32]}
        assert packed.local_shape(tp) == (96 // tp, 32)
        assert program.plan.tensors[out.format(i=i)].role == "row_parallel"
