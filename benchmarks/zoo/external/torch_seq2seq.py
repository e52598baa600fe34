"""torch_seq2seq (external): a translation model on torch's own ``nn.Transformer``
(encoder-decoder, batch_first, dropout 0.1 as torch configures it): encoder and decoder
self-attention packed in one in_proj, the decoder's cross-attention reading it as
``in_proj_weight.split([E, 2E])`` (q from the target, k and v from the memory), source and
target embeddings, a next-token loss on the target.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS = 64, 32, 4


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, DIM)
        self.tgt_emb = nn.Embedding(VOCAB, DIM)
        self.core = nn.Transformer(DIM, HEADS, num_encoder_layers=2, num_decoder_layers=2,
                                   dim_feedforward=64, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.core(self.src_emb(src), self.tgt_emb(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return Seq2Seq()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(1, VOCAB, (4, 10), generator=g), torch.randint(1, VOCAB, (4, 8), generator=g))


def loss_fn(logits, batch):
    tgt = batch[1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))
