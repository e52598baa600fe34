"""A conditioning linear: DiT's adaLN-Zero (facebookresearch/DiT, the zoo's ``dit``):
``adaLN_modulation = Sequential(SiLU(), Linear(h, 6h))`` of a per-sample embedding ``c``,
``.chunk(6, dim=1)`` into shift / scale / gate, ``modulate(x, shift, scale) = x * (1 +
scale.unsqueeze(1)) + shift.unsqueeze(1)`` before attention and the MLP, the gates on their
outputs.

The seed walk from adaLN went on through ``modulate`` (its output broadcast over the
tokens, multiplying the normed residual stream) into qkv and fc1 and took them as its rows:
adaLN column, qkv and fc1 row-parallel on a feature-sharded input (all-reduced), attention
computed whole on every rank, attn.proj and mlp.fc2 replicated (the zoo's dit: 6 of 10
matrices at tp2 and tp4, PASS). A per-sample vector broadcast over the positions of another
activation now ends the walk (planning/tp_seeds.py ``_conditioning``): qkv | proj and
fc1 | fc2 are Megatron pairs, adaLN replicated (its matmul is one row per sample), or,
where the vector comes from the timestep's MLP, the row of that MLP's last linear.

A gate that is not a broadcast (SwiGLU's ``silu(gate(x)) * up(x)``, both per token) and a
per-head scalar broadcast over head_dim are unchanged; a per-position linear broadcast over a
dim of its own (a segsum scan's dt) is no conditioning vector. Each rank equals the unmodified
model (outputs, every gradient, one SGD step; fp32, 1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.planning.tp_seeds import _conditioning
from tp_check import captured, plan_and_check
from tp_small_models import H, SwiGLU, x_batch

HEADS = 4


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(H, elementwise_affine=False, eps=1e-6)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(H, elementwise_affine=False, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(H, 6 * H))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
            self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        h = modulate(self.norm2(x), shift_mlp, scale_mlp)
        return x + gate_mlp.unsqueeze(1) * self.fc2(F.gelu(self.fc1(h)))


class DiT(nn.Module):
    """``time_mlp``: the conditioning vector from the timestep's MLP, a chain of linears into
    every adaLN; else the per-sample vector given as it is."""

    def __init__(self, depth=2, time_mlp=True):
        super().__init__()
        self.t_mlp = nn.Sequential(nn.Linear(16, H), nn.SiLU(), nn.Linear(H, H)) if time_mlp \
            else nn.Identity()
        self.blocks = nn.ModuleList([DiTBlock() for _ in range(depth)])

    def forward(self, x, t):
        c = self.t_mlp(t)
        for block in self.blocks:
            x = block(x, c)
        return x


class PerHeadScale(nn.Module):
    """A per-head scalar from a linear (Gated DeltaNet's beta) broadcast over head_dim."""

    def __init__(self):
        super().__init__()
        self.v, self.b, self.o = nn.Linear(H, H), nn.Linear(H, HEADS), nn.Linear(H, H)

    def forward(self, x):
        B, N, _ = x.shape
        v = self.v(x).view(B, N, HEADS, -1)
        y = v * self.b(x).sigmoid()[..., None]
        return x + self.o(y.reshape(B, N, H))


def _batch(width=16):
    g = torch.Generator().manual_seed(3)
    return (x_batch(2, 6)[0], torch.randn(2, width, generator=g))


@pytest.mark.parametrize("tp", [2, 4])
def test_adaln_conditioning_leaves_attention_and_mlp_pairs(tp):
    """From the timestep's MLP, the adaLN linears are the row of its last linear (the plan
    sharding more parameters of the chain's two, decision 216), never of qkv or fc1."""
    torch.manual_seed(0)
    d = plan_and_check(DiT(), _batch(), tp)
    assert "t_mlp.2.weight" in d.column
    for i in range(2):
        b = f"blocks.{i}."
        assert {b + "attn.qkv.weight", b + "fc1.weight"} <= d.column, d.column
        assert {b + "attn.proj.weight", b + "fc2.weight", b + "adaLN_modulation.1.weight"} \
            <= d.row, d.row


def test_adaln_of_a_given_conditioning_vector_is_replicated_and_says_why():
    torch.manual_seed(0)
    d = plan_and_check(DiT(time_mlp=False), _batch(H), 2)
    for i in range(2):
        b = f"blocks.{i}."
        assert {b + "attn.qkv.weight", b + "fc1.weight"} <= d.column, d.column
        assert b + "adaLN_modulation.1.weight" not in d.column | d.row
        # the report says why (it said "no column/row pair found": a break test)
        (why,) = d.replicated[b + "adaLN_modulation.1.weight"]
        assert why.startswith(f"replicated linear: {b}adaLN_modulation.1.weight (a per-sample "
                              f"conditioning vector (adaLN, FiLM): its output scales or shifts "
                              f"every position at aten."), why


def test_swiglu_gate_and_per_head_scale_still_pair():
    torch.manual_seed(0)
    d = plan_and_check(SwiGLU(), x_batch(), 2)
    assert {"gate.weight", "up.weight"} <= d.column and d.row == {"down.weight"}
    torch.manual_seed(0)
    d = plan_and_check(PerHeadScale(), x_batch(), 2)
    assert {"v.weight", "b.weight"} <= d.column and d.row == {"o.weight"}, (d.column, d.row)


class PairwiseDecay(nn.Module):
    """A per-position linear (B, L, F) broadcast over a dim of its own against a (B, t, s,
    F) tensor, as a hand-written Mamba's segsum scan reads ``dt_proj``: one row per
    position, no conditioning vector (it was reported as one, "a per-sample conditioning
    vector (adaLN, FiLM)", a break test)."""

    def __init__(self):
        super().__init__()
        self.up, self.dt, self.down = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        h = self.up(x)
        pair = h.unsqueeze(2) - h.unsqueeze(1)                       # (B, t, s, H)
        y = (pair * torch.sigmoid(self.dt(x)).unsqueeze(1)).sum(2)   # dt broadcast over t
        return x + self.down(y)


def test_a_per_position_linear_is_no_conditioning_vector():
    torch.manual_seed(0)
    d = plan_and_check(PairwiseDecay(), x_batch(), 2)
    assert not any("conditioning vector" in line for line in d.report), d.report


class DynamicPositionBias(nn.Module):
    """x-transformers' ``dynamic_pos_bias`` (2.31, ``DynamicPositionBias``): an MLP of the
    relative distances ``(2n - 1, 1)`` (depth 2) gives one bias per (distance, head),
    gathered to ``(i, j, heads)``, permuted to ``(heads, i, j)`` and added to the scores
    ``(b, heads, i, j)``: one value for every sample, broadcast over the batch, no
    conditioning vector. With the table's length static it was reported as one and its last
    linear kept whole (zoo 13 Z1); the MLP is now a column | row pair, its bias cut to each
    rank's heads where it meets the scores."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.mlp = nn.Sequential(nn.Linear(1, H), nn.SiLU(), nn.Linear(H, H), nn.SiLU(),
                                 nn.Linear(H, HEADS))
        self.max_len = 5

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        n = self.max_len  # the table's length, as x-transformers' export specialises it
        ar = torch.arange(n, device=x.device)
        pos = self.mlp(torch.arange(-n + 1, n, device=x.device).float()[:, None])
        bias = pos[ar[:, None] - ar[None, :] + n - 1].permute(2, 0, 1)
        w = (q @ k.transpose(-1, -2) + bias).softmax(-1)
        return x + self.o((w @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_bias_broadcast_over_the_batch_is_no_conditioning_vector(tp):
    torch.manual_seed(0)
    d = plan_and_check(DynamicPositionBias(), x_batch(), tp)
    assert d.column == {"qkv.weight", "mlp.2.weight"}, d.report
    assert d.row == {"o.weight", "mlp.4.weight"}, d.report
    assert not any("conditioning vector" in line for line in d.report), d.report


def test_the_walk_reads_a_bias_shared_by_the_batch_as_no_conditioning():
    """The seed walk's own test on the add of the scores and the bias (x-transformers' walk
    from its last bias linear reached it as a start and stopped there, zoo 13 Z1)."""
    torch.manual_seed(0)
    graph = captured(DynamicPositionBias(), x_batch()).gm.graph
    (add,) = [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor
              and any(getattr(a, "target", None) is torch.ops.aten.permute.default
                      for a in n.args)]
    bias = next(a for a in add.args if a.target is torch.ops.aten.permute.default)
    assert not _conditioning(add, bias)
