"""Data-dependent sizes in the compile (the zoo's JetMoE at pp2 crashed it; a pad by such a size, below).

JetMoE routes tokens to experts with ``expert_size.tolist()`` and splits the tokens by those
sizes (``ParallelExperts``), so the captured graph holds unbacked SymInts: the example has no
value for one expert's row count, only for their sum (tokens x top_k). Two compile steps met
them at mesh.pp = 2:

- the pipeline cost model (``analysis/graph_costs.py``) asked such a size for its hint (None)
  to count an expert matmul's FLOPs: it now leaves those ops uncounted with a note, and
  counts what the shape env fixes (the concatenated experts' rows);
- the execution of the emitted stages on FakeTensors (``emit/rank_check.py``) ran the
  ``.tolist()`` under a FakeTensorMode without a shape env, which raises
  ``DataDependentOutputException`` (an "internal error"); with one, the value is an unbacked
  SymInt there as it was in the capture.

Compiled in memory with transformers' JetMoE (2 layers, 4 experts top-2); the zoo's
``python -m benchmarks.zoo --families jetmoe --layouts pp2`` runs it with --verify (PASS).
"""
from __future__ import annotations

import pytest
import torch

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec


def _jetmoe():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.JetMoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                    num_key_value_heads=2, kv_channels=8, intermediate_size=64,
                                    max_position_embeddings=64, num_local_experts=4,
                                    num_experts_per_tok=2, use_cache=False,
                                    attn_implementation="sdpa")
    ids = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    return transformers.JetMoeForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids.clone()}


def test_jetmoe_expert_sizes_from_tolist_compile_at_pp2():
    model, batch = _jetmoe()
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    program = compile_module(model, batch, spec, reference=False)
    assert [st.index for st in program.plan.stages] == [0, 1]
    notes = program.pipeline["notes"]
    uncounted = [n for n in notes if "depends on values" in n]
    assert uncounted and all("not counted" in n for n in uncounted)
    # each stage has one decoder layer, and its FLOPs are counted (the attention, the
    # router, the concatenated experts' rows): not zero
    assert all(st["flops"] > 0 for st in program.pipeline["stages"])
    assert "program/stage1.py" in program.sources


D, HEADS = 32, 4


class PaddedPerSampleAttention(torch.nn.Module):
    """diffusers' Mochi attention, cut down: each sample attends over its own tokens and the
    context tokens its mask keeps (``nonzero``), padded back to the whole length by
    ``F.pad(a, (0, 0, 0, total - a.size(2)))``: a pad by a data-dependent size."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))

    def forward(self, x, ctx, mask):
        s = x.shape[1]
        q, k, v = (m(torch.cat([x, ctx], 1)).unflatten(2, (HEADS, -1)).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        outs = []
        for i in range(x.shape[0]):
            idx = torch.cat([torch.arange(s), s + torch.nonzero(mask[i]).flatten()])
            a = torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1, :, idx], k[i:i + 1, :, idx], v[i:i + 1, :, idx])
            outs.append(torch.nn.functional.pad(a, (0, 0, 0, q.shape[2] - a.size(2))))
        return x + self.o(torch.cat(outs, 0).transpose(1, 2).flatten(2)[:, :s])


def test_a_pad_by_a_data_dependent_size_compiles_at_tp2():
    """The compile's run of each tp rank's program (``emit/rank_check.py``) met aten.pad with
    an unbacked size, whose C++ kernel takes only ints: "SymIntArrayRef expected to contain
    only concrete integers", an internal error at tp2 (zoo 20 Z1, diffusers Mochi). It runs
    under the python dispatcher now, which takes SymInt sizes through the decomposition as
    the capture did; the compile's numerics self-check passes (``--verify`` PASSes too)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    batch = (torch.randn(4, 8, D, generator=g), torch.randn(4, 6, D, generator=g), mask)
    spec = Spec.model_validate({"mesh": {"tp": 2}})
    program = compile_module(PaddedPerSampleAttention(), batch, spec, reference=False)
    assert [program.plan.tensors[f"{m}.weight"].tp_dim for m in "qkvo"] == [0, 0, 0, 1]
