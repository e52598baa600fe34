"""Tensor parallelism over channels (frontend/conv.py, analysis/sharding/channels.py; issue
23: "a conv over channels ... the block still shards its large matmuls"): a pointwise conv
is the linear over channels it computes, ``glu`` the halves it is defined as, and a grouped
(depthwise) conv, a BatchNorm and a GroupNorm over channels that arrive sharded take them
as they are, their per-channel parameters and running statistics sharded with them; Mamba
(transformers' own class: a depthwise conv over in_proj's channels, ``dt_proj.weight @ x``
written weight first, per-channel A_log and D) is sharded whole. Ranks in
lockstep in one process (tests/tp_lockstep.py): outputs, every gradient, the SGD-stepped
parameters and the running statistics each rank's forward wrote equal the unmodified
model's pieces; the compile's self-check compares the statistics too and fails on a rank
holding another rank's piece."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelizer import compiler
from parallelizer.emit import numerics_check
from parallelizer.errors import PlanError
from parallelizer.frontend.spec import Spec
from tp_check import TOL, assert_tp_matches, planned, weighted_loss
from tp_lockstep import local, run_ranks
from tp_small_models import captured

aten = torch.ops.aten


class ConformerConv(nn.Module):
    """Conformer's convolution module (Gulati et al. 2020, §2.2): pointwise conv, GLU,
    depthwise conv, BatchNorm, swish, pointwise conv, on a (B, T, D) residual stream."""

    def __init__(self, d=8, k=3):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = F.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        y = self.pw2(F.silu(self.bn(self.dw(y))))
        return x + y.transpose(1, 2)


class GroupedBlock(nn.Module):
    """A diffusion-UNet-style block over an image: GroupNorm, pointwise conv, GroupNorm,
    grouped 3x3 conv, pointwise conv back (no bias on the grouped conv)."""

    def __init__(self, c=4, groups=2):
        super().__init__()
        self.up = nn.Conv2d(c, 4 * c, 1)
        self.norm = nn.GroupNorm(4, 4 * c)
        self.conv = nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=groups, bias=False)
        self.down = nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        return x + self.down(F.silu(self.conv(F.silu(self.norm(self.up(x))))))


def _seq():
    return (torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(0)),)


def _image():
    return (torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(0)),)


def _stats_match(model, batch, gm, decision, tp):
    """Each rank's running statistics after its forward equal its piece of the model's."""
    model = copy.deepcopy(model)
    model(*batch)
    want = dict(model.named_buffers())
    for r, res in enumerate(run_ranks(gm, decision, tp, list(batch), weighted_loss, 0.0)):
        for fqn in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
            torch.testing.assert_close(res.params[fqn], local(want[fqn], fqn, decision, tp, r),
                                       **TOL, msg=lambda m: f"rank {r} {fqn}: {m}")


def test_pointwise_convs_are_linears_and_glu_its_halves():
    torch.manual_seed(0)
    model = ConformerConv().train()
    gm = captured(model, _seq()).gm
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(aten.linear.default) == 2 and aten.glu.default not in ops
    assert ops.count(aten.conv1d.default) == 1  # the depthwise conv stays a conv
    torch.testing.assert_close(gm(*_seq())[0], model(*_seq()), rtol=1e-6, atol=1e-6)


class MaskedViews(nn.Module):
    """ConvTasNet's mask: a pointwise conv's output times the features, then ``view``ed
    (torchaudio's conv_tasnet.py:299), which needs the product contiguous as eager's is."""

    def __init__(self):
        super().__init__()
        self.mask = nn.Conv1d(8, 16, 1)

    def forward(self, x):
        masked = self.mask(x).view(x.shape[0], 2, 8, -1) * x.unsqueeze(1)
        return masked.view(x.shape[0] * 2, 8, -1).sum(-1)


def test_a_pointwise_conv_as_a_linear_keeps_the_convs_contiguous_output():
    """The permute back from the linear's (N, *S, O) left (N, O, *S) strided, and the
    elementwise product after it took those strides: the model's own ``view`` failed in the
    compile's self-check at tp2 and at pp2 alike (zoo 22 F7, an internal error)."""
    torch.manual_seed(0)
    model, x = MaskedViews(), torch.randn(4, 8, 6)
    gm = captured(model, (x,)).gm
    assert aten.linear.default in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(x)[0], model(x), rtol=1e-6, atol=1e-6)


class GluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.glu(self.up(x)))


def test_glu_after_a_linear_makes_it_a_fused_column():
    """``glu``'s halves are the gate/up parts of one projection: each rank holds its block of
    both (``fused [32, 32]``), where aten.glu had no rule over a sharded dim."""
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)),)
    model = GluMLP()
    gm, decision = planned(model, x, 2)
    assert decision.column == {"up.weight"} and decision.row == {"down.weight"}
    assert decision.layouts["up.weight"].text() == "fused [32, 32]"
    assert_tp_matches(model, x, 2, decision, gm)


@pytest.mark.parametrize("conv", [
    nn.Conv1d(4, 6, 3, padding=1), nn.Conv1d(4, 6, 1, stride=2), nn.Conv1d(4, 6, 1, padding=1),
    nn.Conv1d(4, 6, 1, groups=2)])
def test_a_conv_that_is_no_pointwise_map_stays_a_conv(conv):
    x = torch.randn(2, 4, 5)
    gm = captured(conv, (x,)).gm
    assert aten.linear.default not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(x)[0], conv(x))


def test_the_conformer_convolution_module_shards_every_weight_at_tp2():
    torch.manual_seed(0)
    model = ConformerConv().train()
    gm, decision = planned(model, _seq(), 2)
    assert decision.column == {"pw1.weight"} and decision.row == {"pw2.weight"}
    assert set(decision.per_head) == {"dw.weight", "dw.bias", "bn.weight", "bn.bias",
                                      "bn.running_mean", "bn.running_var"}
    assert all(d == 0 for d in decision.per_head.values())
    assert any(n.target is aten.conv1d.default and n.args[6] == 4 for n in gm.graph.nodes)
    assert_tp_matches(model, _seq(), 2, decision, gm)
    _stats_match(model, _seq(), gm, decision, 2)


def test_grouped_conv_and_group_norm_shard_along_whole_groups():
    torch.manual_seed(0)
    model = GroupedBlock().train()
    gm, decision = planned(model, _image(), 2)
    assert {"conv.weight", "norm.weight", "norm.bias"} <= set(decision.per_head)
    targets = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    assert targets[aten.group_norm.default].args[1] == 2  # 4 groups over 2 ranks
    assert targets[aten.conv2d.default].args[6] == 1
    assert_tp_matches(model, _image(), 2, decision, gm)


def test_instance_norm_over_sharded_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 16, 1), nn.InstanceNorm1d(16, affine=True),
                          nn.Conv1d(16, 8, 1)).train()
    x = (torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(0)),)
    gm, decision = planned(model, x, 2)
    assert decision.column == {"0.weight"} and decision.row == {"2.weight"}
    assert set(decision.per_head) == {"1.weight", "1.bias"}
    assert_tp_matches(model, x, 2, decision, gm)


def test_channels_tp_does_not_divide_are_named_channels():
    """A per-channel tensor's size is named as channels, with the module reading it (it was
    "the number of heads (6) of the model (dim 0 of the per-head 1.weight)"), and a pointwise
    conv's (O, C, 1) weight viewed (O, C) by its features (it was "the 30 heads of pw1")."""
    model = nn.Sequential(nn.Conv1d(8, 6, 1), nn.BatchNorm1d(6), nn.Conv1d(6, 8, 1)).train()
    with pytest.raises(PlanError, match=re.escape(
            "mesh.tp (4) must divide the number of channels (6) of 1 (dim 0 of the per-channel "
            "1.weight); valid choices: tp in {1, 2, 3, 6}")):
        planned(model, (torch.randn(2, 8, 5),), 4)
    model = nn.Sequential(nn.Conv1d(8, 6, 1), nn.GELU(), nn.Conv1d(6, 8, 1))
    with pytest.raises(PlanError, match=re.escape("the number of features (6) of 0 "
                                                  "(out_features of 0.weight)")):
        planned(model, (torch.randn(2, 8, 5),), 4)


def test_groups_tp_does_not_divide_keep_the_conv_whole():
    """2 groups at tp 4: the conv reads its input gathered, the block's pointwise convs and
    its GroupNorm of 4 groups stay sharded."""
    torch.manual_seed(0)
    model = GroupedBlock().train()
    gm, decision = planned(model, _image(), 4)
    assert "conv.weight" not in decision.per_head and {"norm.weight"} <= set(decision.per_head)
    assert {"up.weight"} <= decision.column and {"down.weight"} <= decision.row
    assert_tp_matches(model, _image(), 4, decision, gm)


class PrimerAttention(nn.Module):
    """Primer-EZ's multi-dconv-head attention (So et al. 2021, §3), written as labml-nn does:
    q, k and v each pass a depthwise conv over the sequence that every head shares, run on
    ``x.view(batch * heads, d_k, seq)``."""

    def __init__(self, d=16, heads=4, k=3):
        super().__init__()
        self.h, self.dk, self.k = heads, d // heads, k
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.dconv = nn.ModuleList(nn.Conv1d(self.dk, self.dk, k, padding=k - 1,
                                             groups=self.dk) for _ in range(3))

    def _dconv(self, x, i):
        b, s, h, dk = x.shape
        y = self.dconv[i](x.permute(0, 2, 3, 1).reshape(b * h, dk, s))[:, :, :-(self.k - 1)]
        return y.view(b, h, dk, s).permute(0, 3, 1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.dk)
        k, v = self.kv(x).view(b, s, 2, self.h, self.dk).unbind(2)
        q, k, v = (self._dconv(t, i).transpose(1, 2) for i, t in enumerate((q, k, v)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, s, -1))


def test_a_conv_every_head_shares_runs_on_the_ranks_heads():
    """The (batch x heads) merge puts the sharded heads on the conv's sample dim, which it
    convolves one by one: the heads stay sharded through it (the attention was replicated,
    "aten.conv1d cannot take a sharded input here"), the conv's weight is replicated and its
    gradient summed over tp, each rank seeing its heads only."""
    torch.manual_seed(0)
    model = PrimerAttention()
    x = (torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0)),)
    gm, decision = planned(model, x, 2)
    assert decision.column == {"q.weight", "kv.weight"} and decision.row == {"o.weight"}
    assert not decision.redistributions
    assert "each rank applies it whole to its shard" in decision.other_replicated[
        "dconv.0.weight"]
    assert_tp_matches(model, x, 2, decision, gm)


class HeadConv(nn.Module):
    """Nystromformer's conv over the values of each head (Xiong et al. 2021, §3.3: a depthwise
    Conv2d of ``conv_kernel_size`` taps along the sequence), here 65 taps on 16 tokens."""

    def __init__(self, d=16, heads=4, k=65):
        super().__init__()
        self.h = heads
        self.v, self.o = nn.Linear(d, d), nn.Linear(d, d)
        self.conv = nn.Conv2d(heads, heads, (k, 1), padding=(k // 2, 0), groups=heads,
                              bias=False)

    def forward(self, x):
        b, s, d = x.shape
        v = self.v(x).view(b, s, self.h, d // self.h).transpose(1, 2)
        return x + self.o((v + self.conv(v)).transpose(1, 2).reshape(b, s, d))


def test_a_depthwise_conv_left_with_one_channel_per_rank_runs_without_onednn():
    """At tp = heads each rank's conv has one channel and one group: torch 2.13 runs it on
    oneDNN, whose backward corrupted the heap for a kernel longer than the input (the
    compile's self-check of Nystromformer at tp4 died of SIGSEGV, run.py of SIGABRT). The
    pass runs it as ``conv_one_channel``, the same ATen convolution with oneDNN off."""
    from parallelizer.runtime.one_channel_conv import conv_one_channel
    torch.manual_seed(0)
    model = HeadConv()
    x = (torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),)
    gm, decision = planned(model, x, 4)
    assert decision.per_head == {"conv.weight": 0}
    assert [n.args[6] for n in gm.graph.nodes if n.target is conv_one_channel] == [1]
    assert_tp_matches(model, x, 4, decision, gm)
    gm, decision = planned(model, x, 2)  # two channels per rank: torch's depthwise kernel
    assert not any(n.target is conv_one_channel for n in gm.graph.nodes)
    assert_tp_matches(model, x, 2, decision, gm)


class LastHidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).last_hidden_state


def test_mamba_shards_every_block_matrix_and_its_per_channel_parameters():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4,
                                      num_hidden_layers=1, expand=2, conv_kernel=4,
                                      time_step_rank=4, use_cache=False)
    model = LastHidden(transformers.MambaModel(config)).train()
    ids = (torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0)),)
    gm, decision = planned(model, ids, 2)
    mixer = "model.layers.0.mixer."
    assert decision.column == {mixer + "in_proj.weight", mixer + "dt_proj.weight"}
    assert decision.row == {mixer + "x_proj.weight", mixer + "out_proj.weight"}
    assert {mixer + t for t in ("conv1d.weight", "conv1d.bias", "A_log", "D",
                                "dt_proj.bias")} <= set(decision.per_head)
    assert not decision.redistributions
    assert_tp_matches(model, ids, 2, decision, gm)


def test_the_self_check_compares_the_running_statistics(monkeypatch):
    torch.manual_seed(0)
    model = ConformerConv().train()
    model.bn.running_mean.normal_()  # statistics of earlier steps: each rank's piece differs
    program = compiler.compile_module(model, _seq(), Spec.model_validate({"mesh": {"tp": 2}}),
                                      reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert "3 buffer(s) the forward writes" in note, note
    real = numerics_check.local_piece

    def other_ranks_piece(full, tplan, tp, rank):  # each rank given another rank's statistics
        return real(full, tplan, tp, (rank + 1) % tp if tplan.fqn == "bn.running_mean" else rank)
    monkeypatch.setattr(numerics_check, "local_piece", other_ranks_piece)
    with pytest.raises(PlanError, match=re.escape("differs first at the buffer bn.running_mean")):
        compiler.compile_module(model, _seq(), Spec.model_validate({"mesh": {"tp": 2}}),
                                reference=False)
