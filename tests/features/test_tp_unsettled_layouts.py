"""A layout the propagation cannot settle keeps its group whole (tp_candidates._alternating).

transformers' ZAYA (compressed convolutional attention) at tp 4, 2 kv heads: k_proj is read
per head (``repeat_kv`` into the query residual) and through a grouped convolution over the
q|k channels. Assumed copied per kv head, the propagation then needs it even; assumed even,
copied again: the planner's fixed point never came and the compile died with
``AssertionError: tp planning did not settle`` (a held-out zoo). Now a layout seen before is
a cycle: each weight whose layout alternates keeps its group whole, named in the report, the
rest sharded, and the program passes the numerics self-check against the unmodified model.

The weight named is the group kept whole: where a bias's layout flips with its weight's (a
``D -> 2 D`` linear viewed as 2 candidates mixed by a softmax gate, at tp 4), the bias named
nothing in the plan's column/row sets and the whole model was kept replicated, refused as
"no weight matrix could be sharded" (zoo 9's hw9_pair_mix). Its weight's group is kept whole,
the block's MLP sharded.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer import compiler
from parallelizer.frontend.spec import Spec

from tp_check import assert_tp_matches, planned

T = pytest.importorskip("transformers")


def _zaya():
    torch.manual_seed(0)
    config = T.ZayaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=32, moe_intermediate_size=16, num_experts=2,
                          num_experts_per_tok=1, router_hidden_size=8, pad_token_id=0,
                          use_cache=False, attn_implementation="sdpa")
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return T.ZayaForCausalLM(config).train(), {"input_ids": ids, "labels": ids.clone()}


def test_alternating_kv_layout_keeps_its_group_whole_and_the_program_checks():
    model, batch = _zaya()
    program = compiler.compile_module(model, batch, Spec.model_validate({"mesh": {"tp": 4}}),
                                      reference=False)
    (note,) = [n for n in program.notes if n.startswith("self-check")]
    assert re.match(r"self-check: 4 tp rank\(s\) of the program against the model", note), note
    k = program.plan.tensors["model.layers.0.self_attn.qkv_proj.k_proj.weight"]
    assert k.tp_dim is None and k.layout is None, k
    unsettled = [line for line in program.report.splitlines() if "does not settle" in line]
    assert any("k_proj.weight" in line and "modeling_zaya.py" in line for line in unsettled), \
        program.report[:3000]
    assert any(program.plan.tensors[f].tp_dim is not None for f in program.plan.tensors
               if ".mlp." in f or "experts" in f), "the rest is still sharded"


class _CandidateMix(nn.Module):
    """Two candidate updates from one linear, mixed by a softmax gate; then an MLP."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.d = d
        self.cand, self.gate = nn.Linear(d, 2 * d), nn.Linear(d, 2)
        self.out, self.up, self.down = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        g = self.gate(x).softmax(-1).unsqueeze(-1)
        x = x + self.out((self.cand(x).view(b, t, 2, self.d) * g).sum(2))
        return x + self.down(F.relu(self.up(x)))


def test_a_bias_whose_layout_flips_keeps_its_weights_group_whole_not_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(_CandidateMix(), _CandidateMix())
    batch = (torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)),)
    gm, d = planned(model, batch, 4)
    assert d.column == {"0.up.weight", "1.up.weight"}
    assert d.row == {"0.down.weight", "1.down.weight"}
    kept = [line for line in d.report if line.startswith("kept replicated:")]
    assert any(line.startswith("kept replicated: 0.cand.weight, 0.out.weight (")
               for line in kept), kept
    assert not any("up.weight" in line for line in kept), kept
    assert_tp_matches(model, batch, 4, d, gm)
