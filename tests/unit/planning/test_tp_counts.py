"""The compile's count line, ``N of M weight matrices in blocks sharded``, counts matrices:
the blocks' (a Sequential of them, every ModuleList), those outside them, a model's own
where it has no blocks, einsum weights kept whole; and the line after names the first left
whole. vit-pytorch's NesT keeps its channel LayerNorm's gains as ``(1, C, 1, 1)`` and CaiT its
LayerScale as ``(1, 1, D)``, which the line counted as weight matrices left whole ("8 of 19"
for NesT at tp2, zoo 11, where every matrix was sharded) and report.md listed as "replicated
... no tensor-parallel rule splits a weight this op reads". A vector stays a vector however
many dims it keeps; a 2-D weight (a projection to one feature) is still a matrix."""
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.analysis.graph_facts import read_attrs
from parallelizer.passes.tensor_parallel import apply_tensor_parallel
from parallelizer.planning.tp import plan_tp
from parallelizer.planning.blocks import find_blocks
from parallelizer.planning.tp_matrices import (block_matrices, is_matrix, linear_counts,
                                               tp_kept_note, tp_summary)

from tp_small_models import H, MLP, captured, x_batch


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


def test_block_matrices_count_sequential_blocks_and_every_module_list():
    """timm's ViT keeps its blocks in an nn.Sequential (find_blocks finds them): the summary
    counted 0 of 0 matrices; an encoder-decoder's two ModuleLists both count."""

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(MLP() for _ in range(3)))

        def forward(self, x):
            return self.blocks(x)

    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(MLP() for _ in range(2))
            self.dec = nn.ModuleList(MLP() for _ in range(3))

    seq = Seq()
    assert len(block_matrices(seq, find_blocks(seq))) == 6 and not block_matrices(seq)
    encdec = EncDec()
    assert len(block_matrices(encdec, find_blocks(encdec))) == 10


# --- every weight matrix left whole is named and counted -------------------------------------

class EinsumBlock(nn.Module):
    """An MLP (a column/row pair) beside two einsums of weights that are no linear map (the
    einsum projections that are, capture makes linears: test_einsum_projections.py): a
    per-head block-diagonal map (``"bshd,hde->bshe"``, 3-D) and a per-head dot product
    (``"bshd,hd->bsh"``, 2-D)."""

    def __init__(self):
        super().__init__()
        self.w2 = nn.Parameter(0.1 * torch.randn(4, H // 4))
        self.w3 = nn.Parameter(0.1 * torch.randn(4, H // 4, H // 4))
        self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        b, s, _ = x.shape
        x = x + torch.einsum("bshd,hde->bshe", x.view(b, s, 4, H // 4), self.w3).flatten(2)
        x = x + torch.einsum("bshd,hd->bsh", x.view(b, s, 4, H // 4), self.w2).mean(
            -1, keepdim=True)
        return x + self.fc2(F.gelu(self.fc1(x)))


class EinsumBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(EinsumBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_einsum_weights_kept_whole_are_reported_and_counted():
    """Einsum weights no rule splits stay replicated; each is named with the op and line
    that reads it, counted in the linears' line and, 3-D ones too, among the blocks' weight
    matrices (main before: 'replicated: none' and '4 of 6 weight matrices', the 3-D weights
    not counted). The per-head block-diagonal map is H linears side by side (decision 115),
    replicated for want of a pair; the per-head dot product stays an einsum."""
    from tp_check import assert_tp_matches
    model = EinsumBlocks()
    cap = captured(model, x_batch())
    d = plan_tp(cap.gm.graph, 2)
    whole = [f"blocks.{i}.w2" for i in range(2)]
    assert sorted(d.other_replicated) == whole
    assert linear_counts(d).endswith(
        "replicated: 2 linears (blocks.0.w3, blocks.1.w3); "
        f"replicated too: 2 other weight matrices ({', '.join(whole)})")
    for i in range(2):
        assert any(line.startswith(f"replicated linear: blocks.{i}.w3 (no column/row pair "
                                   "found; aten.matmul.default at test_tp_counts.py:")
                   for line in d.report)
    for fqn, line in d.other_replicated.items():
        assert line in d.report and line.startswith(f"replicated: {fqn} (")
        assert "read by aten.einsum.default at test_tp_counts.py:" in line, line
    assert tp_summary(d, model).startswith("tensor parallel: 4 of 8 weight matrices in blocks "
                                           "sharded (")
    # the line after the count names the first one left whole, with its report.md line
    assert tp_kept_note(d, model) == (f"tensor parallel: not sharded blocks.0.w2 and 3 more; "
                                      f"{d.other_replicated['blocks.0.w2']} (report.md gives each)")
    apply_tensor_parallel(cap.gm, d)
    assert_tp_matches(model, x_batch(), 2, d, cap.gm)


class NoBlocks(nn.Module):
    """No nn.ModuleList and no repeated modules: an MLP whose input features are scaled
    in groups of 16 by the diagonal of a learned 2 x 2 matrix (replicated)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.mix = nn.Parameter(torch.eye(2) + 0.1 * torch.randn(2, 2))

    def forward(self, x):
        b, t, _ = x.shape
        # its diagonal: no linear map (a mix of the groups, "btgd,gh->bthd", is a linear)
        x = torch.einsum("btgd,gg->btgd", x.view(b, t, 2, H // 2), self.mix).reshape(b, t, H)
        return self.fc2(F.gelu(self.fc1(x)))


def test_model_without_blocks_counts_its_whole_model_and_never_rounds_to_100():
    """Main before: 'tensor parallel: 0 of 0 weight matrices in blocks sharded (100 % of
    parameters)'. With no blocks the line says so and counts the model's matrices; a share
    that rounds to 100 while a parameter is left whole is shown to a tenth."""
    model = NoBlocks()
    d = plan_tp(captured(model, x_batch()).gm.graph, 2)
    assert list(d.other_replicated) == ["mix"]
    split = 2 * 4 * H * H + 4 * H   # fc1 (weight, bias), fc2's weight
    total = split + H + 4
    assert f"{100 * split / total:.0f}" == "100"
    assert find_blocks(model) == ()
    assert tp_summary(d, model, blocks=find_blocks(model)) == (
        f"tensor parallel: no repeated blocks found; 2 of 3 weight matrices in the model "
        f"sharded ({100 * split / total:.1f} % of parameters)")


class BlocksThenMLP(nn.Module):
    """Repeated blocks whose only matrices stay whole (an elementwise gate), then an MLP
    outside them (a ResNet with its one attention block between the stages)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(H, 1) for _ in range(2))
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        for gate in self.blocks:
            x = x * torch.sigmoid(gate(x))
        return self.fc2(F.gelu(self.fc1(x)))


def test_matrices_sharded_outside_the_blocks_are_counted_too():
    """Main before: '0 of 2 weight matrices in blocks sharded (95 % of parameters)', the MLP
    the report lists as column and row parallel not mentioned (a new-user break test)."""
    model = BlocksThenMLP()
    d = plan_tp(captured(model, x_batch()).gm.graph, 2)
    assert {"fc1.weight", "fc2.weight"} <= set(d.column) | set(d.row)
    assert tp_summary(d, model).startswith("tensor parallel: 0 of 2 weight matrices in blocks "
                                           "sharded; 2 of 2 outside them (")
    assert tp_kept_note(d, model).startswith("tensor parallel: not sharded blocks.0.weight and "
                                             "1 more; ")
