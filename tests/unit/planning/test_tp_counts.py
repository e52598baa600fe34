"""The compile's count line, ``N of M weight matrices in blocks sharded``, counts matrices:
vit-pytorch's NesT keeps its channel LayerNorm's gains as ``(1, C, 1, 1)`` and CaiT its
LayerScale as ``(1, 1, D)``, which the line counted as weight matrices left whole ("8 of 19"
for NesT at tp2, zoo 11, where every matrix was sharded) and report.md listed as "replicated
... no tensor-parallel rule splits a weight this op reads". A vector stays a vector however
many dims it keeps; a 2-D weight (a projection to one feature) is still a matrix."""
import torch
from torch import nn

from parallelizer.analysis.graph_facts import read_attrs
from parallelizer.planning.tp import plan_tp
from parallelizer.planning.tp_matrices import is_matrix, tp_summary

from tp_small_models import H, captured, x_batch


class ScaledBlock(nn.Module):
    """An MLP with a LayerScale ``(1, 1, H)`` and a gain stored ``(1, 1, H)``."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.scale = nn.Parameter(torch.full((1, 1, H), 0.1))
        self.gain = nn.Parameter(torch.ones(1, 1, H))

    def forward(self, x):
        return x + self.scale * self.down(torch.relu(self.up(x * self.gain)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_vectors_kept_in_more_dims_are_not_counted_as_matrices():
    assert not is_matrix(torch.ones(1, 8, 1, 1)) and not is_matrix(torch.ones(4, 1, 1))
    assert is_matrix(torch.ones(1, 8)) and is_matrix(torch.ones(3, 8, 1, 1))
    torch.manual_seed(0)
    model = Net()
    d = plan_tp(captured(model, x_batch()).gm.graph, 2)
    assert tp_summary(d, model).startswith("tensor parallel: 4 of 4 weight matrices in blocks "
                                           "sharded"), tp_summary(d, model)
    assert not d.other_replicated, d.other_replicated


class FirstTwo(Net):
    """Three blocks, forward runs two (zoo 17's ``self.layers[:-1]``)."""

    def __init__(self):
        super().__init__()
        self.blocks.append(ScaledBlock())

    def forward(self, x):
        for block in self.blocks[:-1]:
            x = block(x)
        return x


def test_a_block_forward_never_runs_is_not_counted():
    """Its matrices are in no stage and no checkpoint (the compile warns of them): the line
    counted them as left whole ("4 of 6") and now leaves them out, saying so."""
    torch.manual_seed(0)
    model = FirstTwo()
    graph = captured(model, x_batch()).gm.graph
    line = tp_summary(plan_tp(graph, 2), model, read=read_attrs(graph))
    assert line.startswith("tensor parallel: 4 of 4 weight matrices in blocks sharded"), line
    assert line.endswith("; 2 weight matrices forward never reads not counted"), line


class TalkingHeads(nn.Module):
    """Talking-heads attention (Shazeer et al. 2020): the scores mixed across the heads by
    (heads, heads) weights before and after the softmax; the plan makes the first row
    parallel over the heads, summing the (B, heads, T, T) scores over tp every step."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.pre, self.post = (nn.Parameter(torch.eye(heads) + 0.1) for _ in range(2))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = torch.einsum("bhij,hg->bgij", q @ k.transpose(-1, -2), self.pre).softmax(-1)
        att = torch.einsum("bhij,hg->bgij", att, self.post)
        return x + self.o((att @ v).transpose(1, 2).reshape(B, T, H))


def test_the_report_names_the_largest_value_the_rows_sum():
    """The report listed no collective for the scores' sum (zoo 21): a reader of "12 of 12
    sharded" took the attention for head-sharded throughout."""
    x = x_batch(2, 16)  # scores of 2 x 4 x 16 x 16, the residual stream 2 x 16 x 32
    d = plan_tp(captured(nn.Sequential(TalkingHeads(), TalkingHeads()), x).gm.graph, 2)
    assert "0.pre" in d.row, d.report
    (line,) = [r for r in d.report if r.startswith("summed over tp every step")]
    assert line.startswith("summed over tp every step (Megatron's g): 4 row_parallel output(s), "
                           "6,144 elements on the example batch; the largest 2x16x16x4 = 2,048, "
                           "of 0.pre (aten.linear.default at test_tp_counts.py:"), line
