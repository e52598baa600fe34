"""detr_decoder (external): a DETR-style detector in plain PyTorch: a small conv backbone,
its feature map flattened to a memory, learned object queries decoded by
``nn.TransformerDecoder`` (post-norm, ReLU, dropout 0.1 as torch configures it;
self-attention over the queries, cross-attention into the memory through
``in_proj_weight.split([E, 2E])``), class and box heads, a cross-entropy + L1 loss.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, QUERIES, CLASSES = 32, 4, 5, 7


class Detr(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, DIM, 3, stride=2, padding=1))
        self.query = nn.Embedding(QUERIES, DIM)
        layer = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=64, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=3)
        self.cls = nn.Linear(DIM, CLASSES + 1)
        self.box = nn.Linear(DIM, 4)

    def forward(self, images, classes, boxes):  # targets: for loss_fn
        mem = self.backbone(images).flatten(2).transpose(1, 2)
        q = self.query.weight.unsqueeze(0).expand(images.shape[0], -1, -1)
        h = self.decoder(q, mem)
        return self.cls(h), self.box(h).sigmoid()


def build_model():
    torch.manual_seed(0)
    return Detr()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, 3, 16, 16, generator=g),
            torch.randint(0, CLASSES + 1, (4, QUERIES), generator=g),
            torch.rand(4, QUERIES, 4, generator=g))


def loss_fn(outputs, batch):
    logits, boxes = outputs
    return F.cross_entropy(logits.reshape(-1, CLASSES + 1), batch[1].reshape(-1)) \
        + F.l1_loss(boxes, batch[2])
