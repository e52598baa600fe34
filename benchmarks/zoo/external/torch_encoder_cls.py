"""torch_encoder_cls (external): a text classifier on torch's nn.TransformerEncoder of
nn.TransformerEncoderLayer(batch_first=True, norm_first=True, activation="gelu"), dropout 0.1,
a padding mask passed as ``src_key_padding_mask`` (trailing positions padded), learned
positions, mean pooling over the unpadded tokens, a Linear classification head, CE loss in forward.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BATCH, SEQ = 96, 4, 16
NUM_CLASSES = 5
PAD = 0


class TextClassifier(nn.Module):
    def __init__(self, vocab_size=VOCAB, d_model=64, nhead=4, num_layers=2, dim_feedforward=128,
                 dropout=0.1, max_len=64, num_classes=NUM_CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=dim_feedforward,
                                           dropout=dropout, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=num_layers,
                                             norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_classes)

    def forward(self, input_ids, attention_mask, labels=None):
        # attention_mask: 1 for real tokens, 0 for padding
        x = self.embed(input_ids) + self.pos[:, : input_ids.size(1)]
        padding_mask = attention_mask == 0
        x = self.encoder(x, src_key_padding_mask=padding_mask)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss


def build_model():
    torch.manual_seed(0)
    return TextClassifier()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ, SEQ - 3, SEQ // 2, SEQ - 1])[:BATCH]
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)}
