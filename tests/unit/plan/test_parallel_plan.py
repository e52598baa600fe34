"""The plan is computed before the rewrite and holds what the runtime needs: gradient-sync
rank groups (tied weights across stages, kv-head copies), their re-placement under another
schedule, checkpointed blocks; the split graphs are checked against it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from parallelizer.compiler import compile_model
from parallelizer.passes.split_check import SplitMismatch, check_split
from parallelizer.plan.schedules import with_schedule
from parallelizer.plan.parallel_plan import (ParallelPlan, StagePlan, TensorPlan,
                                             checkpointed_blocks, global_rank, grad_sync_groups)
from parallelizer.frontend.spec import load_spec
from parallelizer.plan.layouts import Fused, ReplicatedHeads

REPO = Path(__file__).resolve().parents[3]


def _plan(pp: int, dp: int, tp: int, ranks: tuple, kv_heads: int | None = None) -> ParallelPlan:
    last = len(ranks) - 1
    tensors = {
        "embed.weight": TensorPlan("embed.weight", (16, 8), "float32", None, (0, last)),
        "layers.0.k.weight": TensorPlan(
            "layers.0.k.weight", (8, 8), "float32", 0 if kv_heads else None, (0,),
            layout=ReplicatedHeads(kv_heads, 4) if kv_heads else None),
        "rope.inv_freq": TensorPlan("rope.inv_freq", (2,), "float32", None, (0, last), is_buffer=True),
    }
    stages = tuple(StagePlan(s, f"stage{s}", (), (), (), (), r) for s, r in enumerate(ranks))
    return ParallelPlan(mesh={"pp": pp, "dp": dp, "tp": tp}, zero_stage=0, schedule="1f1b",
                        microbatches=4, seed=0, tensors=tensors, aliases={}, stages=stages,
                        virtual_stages=len(ranks) // pp)


def test_global_rank_is_row_major_over_pp_dp_tp():
    mesh = {"pp": 2, "dp": 3, "tp": 4}
    seen = [global_rank(mesh, p, d, t) for p in range(2) for d in range(3) for t in range(4)]
    assert seen == list(range(24))


def test_tied_weight_summed_over_pp_ranks_per_dp_tp_coordinate():
    groups = grad_sync_groups(_plan(pp=2, dp=2, tp=2, ranks=(0, 1)))
    # buffers held by two stages (rotary tables) are not trained: no group for them
    assert groups == ({"kind": "tied", "key": [0, 1], "ranks": [[0, 4], [1, 5], [2, 6], [3, 7]]},)


def test_kv_head_copies_summed_over_the_tp_ranks_holding_them():
    groups = grad_sync_groups(_plan(pp=1, dp=2, tp=4, ranks=(0,), kv_heads=2))
    assert groups == ({"kind": "replicated_heads", "key": 2,
                       "ranks": [[0, 1], [2, 3], [4, 5], [6, 7]]},)
    one_head = grad_sync_groups(_plan(pp=1, dp=1, tp=4, ranks=(0,), kv_heads=1))
    assert one_head[0]["ranks"] == [[0, 1, 2, 3]]
    # Falcon's fused q|k|v with its one k and v head copied: the same group as one kv head
    plan = _plan(pp=1, dp=2, tp=2, ranks=(0,))
    rh = ReplicatedHeads(1, 2)
    plan.tensors["layers.0.k.weight"] = TensorPlan(
        "layers.0.k.weight", (8, 8), "float32", 0, (0,), layout=Fused((4, 2, 2), (None, rh, rh)))
    assert grad_sync_groups(plan) == ({"kind": "replicated_heads", "key": 1,
                                       "ranks": [[0, 1], [2, 3]]},)


def test_v_placement_keeps_a_tied_pair_on_one_rank_without_a_group():
    loop = _plan(pp=2, dp=1, tp=1, ranks=(0, 1, 0, 1))          # stages 0 and 3: ranks 0, 1
    assert grad_sync_groups(loop)[0]["ranks"] == [[0, 1]]
    v = with_schedule(dataclasses.replace(loop, grad_sync=grad_sync_groups(loop)), "zbv")
    assert [st.rank for st in v.stages] == [0, 1, 1, 0]          # stages 0 and 3 on rank 0
    assert v.grad_sync == ()                                     # summed locally, no group


def test_checkpointed_blocks_follow_the_mode():
    blocks = ("b.0", "b.1", "b.2", "b.3", "b.4")
    assert checkpointed_blocks(blocks, "none", 2) == ()
    assert checkpointed_blocks(blocks, "full", 2) == blocks
    assert checkpointed_blocks(blocks, "selective", 2) == ("b.0", "b.2", "b.4")
    assert checkpointed_blocks(blocks, "selective", 3) == ("b.0", "b.3")


def test_plan_json_round_trip_keeps_the_new_fields():
    plan = _plan(pp=2, dp=1, tp=2, ranks=(0, 1), kv_heads=1)
    plan = dataclasses.replace(plan, grad_sync=grad_sync_groups(plan), checkpointed=("b.0",),
                               settings={"optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}})
    assert ParallelPlan.from_json(plan.to_json()) == plan


@pytest.fixture(scope="module")
def llama_pp2():
    spec = load_spec(REPO / "examples/llama/spec.yaml",
                     ["mesh.tp=1", "mesh.dp=1", "mesh.pp=2", "activation_checkpointing.mode=selective"])
    return compile_model(REPO / "examples/llama/model.py", spec, weights=False)


def test_compiled_plan_records_what_the_runtime_reads(llama_pp2):
    plan = llama_pp2.plan
    assert plan.settings == {
        "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.0, "max_norm": None,
                      "schedule": {"warmup_steps": 0, "decay": "constant", "decay_steps": None,
                                   "min_lr": 0.0}},
        "verify": {"atol": 1e-5, "rtol": 1e-5, "optimizer": "sgd"},
        "train": {"grad_accum": 1}, "compile": False,
        # the token ids' vocabulary: the rows of the embedding they index (planning/tensors.py)
        "data": {"path": None, "dtype": "uint16", "seq_len": None, "batch_size": None,
                 "shuffle": True, "eval": None, "eval_batches": 8, "vocab_size": 128}}
    blocks = [b for st in plan.stages for b in st.blocks]
    assert plan.checkpointed == tuple(blocks[::2])
    tied = [g for g in plan.grad_sync if g["kind"] == "tied"]
    assert tied == [{"kind": "tied", "key": [0, 1], "ranks": [[0, 1]]}]  # embed = lm_head
    assert all(st.inputs for st in plan.stages)       # boundary names recorded after the split


def test_split_graphs_that_disagree_with_the_plan_are_an_internal_error(monkeypatch):
    """The compiler checks the split graphs against the plan made before the rewrite: a plan
    that leaves a tensor off stage 0 must fail the compile, naming the stage and tensor."""
    import parallelizer.compiler as compiler
    seen = {}

    def tampered(plan, stages, block_graphs, canonical, whole=frozenset()):
        first = plan.stages[0]
        seen["fqn"] = first.fqns[0]
        wrong = dataclasses.replace(plan, stages=(
            dataclasses.replace(first, fqns=first.fqns[1:]),) + plan.stages[1:])
        return check_split(wrong, stages, block_graphs, canonical, whole)

    monkeypatch.setattr(compiler, "check_split", tampered)
    spec = load_spec(REPO / "examples/gpt/spec.yaml", ["mesh.tp=1", "mesh.dp=1", "mesh.pp=2"])
    with pytest.raises(SplitMismatch, match="stage 0 .*lacks") as e:
        compile_model(REPO / "examples/gpt/model.py", spec, weights=False)
    assert seen["fqn"] in str(e.value)


UNUSED_TIED = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 16)
        self.extra = nn.Embedding(5, 8)      # LUKE's entity embeddings: no entity inputs here
        self.extra_head = nn.Linear(8, 5, bias=False)
        self.extra_head.weight = self.extra.weight

    def forward(self, ids):
        return self.fc(self.emb(ids))

def build_model():
    torch.manual_seed(0)
    return Model()

def example_inputs():
    return (torch.randint(0, 16, (2, 4)),)
"""


def test_a_tied_pair_forward_never_reads_leaves_no_alias_in_the_manifest(tmp_path):
    """Its tensor is in no stage and not in the checkpoint; its alias was, and every rank of
    run.py refused the manifest ('alias ... names ..., which is not in tensors'): LUKE's
    --verify at tp2 x pp2, at any layout."""
    import json
    from parallelizer.checkpoint.manifest_schema import validate_manifest
    from parallelizer.compiler import compile_to_dir
    (tmp_path / "model.py").write_text(UNUSED_TIED)
    (tmp_path / "spec.yaml").write_text("mesh:\n  tp: 1\n")
    out = tmp_path / "out"
    compile_to_dir(tmp_path / "model.py", load_spec(tmp_path / "spec.yaml"), out)
    ckpt = out / "checkpoint"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert "extra_head.weight" not in manifest["aliases"]
    validate_manifest(ckpt, manifest, ckpt / "manifest.json")
