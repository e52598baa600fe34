"""A Llama 3 written as Meta's reference and torchtitan write it
(tests/distributed/user_models/llama3_reference.py; issue 23, part 4): a complex64 rotary
buffer, ``view_as_complex`` on q and k, GQA by ``repeat_interleave``. At tp 2 (tp divides
the kv heads) and tp 4 (each kv head copied to two ranks), and with one kv head
(multi-query), every matrix of the blocks is sharded and the ranks in lockstep give the
unmodified model's outputs, gradients and SGD step (tests/tp_lockstep.py). The torchrun runs
(--verify at tp2 x pp2, and with the table in one module every block holds at pp2 x dp2 and
tp2 x pp2) are tests/distributed/test_complex_pipelines.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from parallelizer.plan.layouts import ReplicatedHeads
from tp_check import plan_and_check
from tp_weight_path_models import ComplexNet, half_batch

FILE = Path(__file__).resolve().parents[1] / "distributed" / "user_models" / "llama3_reference.py"


def _module():
    spec = importlib.util.spec_from_file_location("llama3_reference", FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kv_heads, tp", [(2, 2), (2, 4), (1, 2), (1, 4)])
def test_repeat_interleave_gqa_shards_every_matrix_and_matches(kv_heads, tp):
    m = _module()
    model = m.build_model(kv_heads)
    batch = (m.example_inputs()[0][:2, :8],)
    d = plan_and_check(model, batch, tp)
    mats = [n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    assert set(mats) <= set(d.dims), sorted(set(mats) - set(d.dims))
    copied = kv_heads < tp
    layout = d.layouts.get("layers.0.attention.wk.weight")
    assert isinstance(layout, ReplicatedHeads) == copied, layout


def test_complex_hidden_state_unflatten_size_made_local():
    """A complex activation between blocks: the planner pairs each block's down with the next
    block's up through view_as_complex / view_as_real, and the ``unflatten`` size on the
    sharded dim becomes local (it stayed global and the program failed at run time:
    "unflatten: Provided sizes [16, 2] don't multiply up to the size of dim 2 (16)")."""
    torch.manual_seed(0)
    model = ComplexNet()
    d = plan_and_check(model, half_batch(3, 5, seed=1), 2)
    assert "layers.0.down.weight" in d.column and "layers.1.up.weight" in d.row
    assert any(n.startswith("unflatten") for n in d.rewrites), d.rewrites
