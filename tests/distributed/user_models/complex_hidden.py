"""A residual MLP stack on a complex hidden state (issue 23, part 4): complex64 activations
carrying gradient cross every block boundary, hence every pipeline stage boundary. Each
block views the state as real for its matmuls (``view_as_real(z).flatten(-2)``) and back
(``view_as_complex(x.unflatten(-1, (F, 2)))``).

Contract: build_model(), example_inputs()."""
import torch
import torch.nn as nn

H, LAYERS = 32, 4


class ComplexBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, z):
        x = torch.view_as_real(z).flatten(-2)
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        return torch.view_as_complex(x.unflatten(-1, (H // 2, 2)).contiguous())


class ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(H // 2, H), nn.Linear(H, 8)
        self.layers = nn.ModuleList(ComplexBlock() for _ in range(LAYERS))

    def forward(self, x):
        z = torch.view_as_complex(self.inp(x).unflatten(-1, (H // 2, 2)).contiguous())
        for layer in self.layers:
            z = layer(z)
        return self.out(torch.view_as_real(z).flatten(-2))


def build_model():
    torch.manual_seed(0)
    return ComplexNet()


def example_inputs():
    return (torch.randn(8, 6, H // 2, generator=torch.Generator().manual_seed(1)),)
