"""Any weight path (issue 23, part 4): linears whose weight is cast, viewed or transposed
before the matmul are found by their algebra and sharded Megatron-style; the tp ranks run
in lockstep in one process (tests/tp_lockstep.py) and give the unmodified model's outputs,
every gradient and the parameters after one SGD step (fp32, 1e-5).
Models: tests/tp_weight_path_models.py; the check: tests/tp_check.py."""
from __future__ import annotations

import pytest
import torch

from parallelizer.analysis.graph_facts import as_linear
from tp_check import plan_and_check
from tp_small_models import captured
from tp_weight_path_models import CastNet, x_batch

MODES = ["to", "type_as", "view", "io", "matmul_to", "float_T"]


@pytest.mark.parametrize("mode", MODES)
def test_linear_found_through_casts_views_and_transposes(mode):
    torch.manual_seed(0)
    cap = captured(CastNet(mode), x_batch())
    sites = {s.weight: s for s in map(as_linear, cap.gm.graph.nodes) if s is not None}
    assert len(sites) == 12, sorted(sites)
    up = sites["layers.0.up.weight"]
    assert up.bias == "layers.0.up.bias" and up.param.target == up.weight
    assert up.out_dim == (1 if mode == "io" else 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_cast_weights_shard_column_row_and_match(mode, tp):
    torch.manual_seed(0)
    model = CastNet(mode)
    d = plan_and_check(model, x_batch(3, 5, seed=1), tp)
    for i in range(2):
        p = f"layers.{i}."
        assert {p + f"attn.{n}.weight" for n in "qkv"} | {p + "up.weight"} <= d.column
        assert {p + "attn.o.weight", p + "down.weight"} <= d.row
    assert d.dims["layers.0.up.weight"] == (1 if mode == "io" else 0)
    assert d.dims["layers.0.up.bias"] == 0
