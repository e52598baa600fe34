"""mlp_mixer (external): an MLP-Mixer as lucidrains/mlp-mixer-pytorch and google-research's
vision_transformer write it, in plain PyTorch: a conv stem to patches, token-mixing MLPs over
the patch dim (``transpose(1, 2)``, Linear over patches, back), channel-mixing MLPs, pre-norm
residuals, dropout 0.1, a mean-pooled classifier with cross-entropy.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IMAGE, PATCH, CLASSES = 4, 32, 4, 5


class MlpBlock(nn.Module):
    def __init__(self, dim, hidden, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class MixerBlock(nn.Module):
    def __init__(self, num_patches, dim, tokens_mlp_dim, channels_mlp_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mixing = MlpBlock(num_patches, tokens_mlp_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mixing = MlpBlock(dim, channels_mlp_dim)

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)          # b, c, n
        y = self.token_mixing(y).transpose(1, 2)   # b, n, c
        x = x + y
        return x + self.channel_mixing(self.norm2(x))


class MlpMixer(nn.Module):
    def __init__(self, num_classes=CLASSES, num_blocks=2, patch_size=PATCH, hidden_dim=32,
                 tokens_mlp_dim=64, channels_mlp_dim=128):
        super().__init__()
        num_patches = (IMAGE // patch_size) ** 2
        self.stem = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.blocks = nn.ModuleList([MixerBlock(num_patches, hidden_dim, tokens_mlp_dim, channels_mlp_dim)
                                     for _ in range(num_blocks)])
        self.pre_head_layer_norm = nn.LayerNorm(hidden_dim)
        self.head = nn.Linear(hidden_dim, num_classes)

    def forward(self, images, labels):  # labels: for loss_fn
        x = self.stem(images)
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        x = self.pre_head_layer_norm(x)
        return self.head(x.mean(dim=1))


def build_model():
    torch.manual_seed(0)
    return MlpMixer()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))


def loss_fn(outputs, batch):
    return F.cross_entropy(outputs, batch[1])
