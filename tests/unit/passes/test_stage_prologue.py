"""TimeSformer's shape (timesformer-pytorch 0.4.1) under pp2: a frame rotary table computed
once from a buffer and the number of frames, read by every layer, and sizes (``b * n``) that
the first layer computes and the later ones reuse. The later stage received the table (no
tensor it receives has the frames as a dim, so it cannot recompute it) while the plan gave
it the buffer too, and its copies of the sizes kept the first layer's module, as if the
stage held that layer: a raw ``SplitMismatch`` traceback, "lacks
['rot.inv_freq']; blocks ('layers.0', 'layers.1') vs planned ('layers.1',)" (zoo 12 F22).
A stage's recomputed values carry no module now, and a planned buffer the stage does not
read (it receives what is computed from it) is no mismatch."""
import torch
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

F_, P, D = 4, 3, 16


class _FrameRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, D, 2).float() / D)))

    def forward(self, f):
        freqs = torch.einsum("i,j->ij", torch.arange(f).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        return emb.sin(), emb.cos()


class _TimeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, sin, cos, f):
        b, fn, d = x.shape
        n = fn // f
        y = x.reshape(b, f, n, d).transpose(1, 2).reshape(b * n, f, d)  # frames per patch
        y = y * cos + y.flip(-1) * sin
        return x + self.lin(y.reshape(b, n, f, d).transpose(1, 2).reshape(b, fn, d))


class _Video(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.rot = nn.Linear(5, D), _FrameRotary()
        self.layers = nn.ModuleList(_TimeLayer() for _ in range(2))

    def forward(self, video):
        b, f, p, _ = video.shape
        x = self.proj(video).reshape(b, f * p, D)
        sin, cos = self.rot(f)
        for layer in self.layers:
            x = layer(x, sin, cos, f)
        return x


def test_a_stage_receiving_a_table_holds_its_buffer_unread_and_no_earlier_block():
    torch.manual_seed(0)
    batch = (torch.randn(4, F_, P, 5, generator=torch.Generator().manual_seed(1)),)
    program = compiler.compile_module(_Video(), batch, Spec.model_validate(
        {"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}}), lambda out, b: out.square().mean())
    assert [st.blocks for st in program.plan.stages] == [("layers.0",), ("layers.1",)]
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "max abs err 0," in note, note
