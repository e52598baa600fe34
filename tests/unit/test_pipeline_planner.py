"""Pipeline planner: find_blocks (the model's largest nn.ModuleList) and plan_pipeline
(contiguous min-max split of blocks into stages; embeddings count toward stage 0 and the
head toward the last stage, which may hold the head alone), with the spec's overrides."""
import itertools
import random

import pytest
import torch
from torch import nn

from parallelizer.errors import PlanError
from parallelizer.planning.pipeline import PipelineDecision, find_blocks, plan_pipeline


def names(n, prefix="model.layers"):
    return tuple(f"{prefix}.{i}" for i in range(n))


def brute_force(block_params, pre, post, pp) -> int:
    """Min over all contiguous splits of [pre + block 0, ..., block n-1, post] into pp
    non-empty stages (post may be a stage alone, pre may not) of the max stage cost."""
    units = list(block_params) + [post]
    units[0] += pre
    n, best = len(units), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0,) + cuts + (n,)
        costs = [sum(units[a:b]) for a, b in zip(bounds, bounds[1:])]
        best = max(costs) if best is None else min(best, max(costs))
    return best


def check_well_formed(d: PipelineDecision, block_params, pre, post, pp):
    assert len(d.stage_of_block) == len(block_params)
    head_alone = d.stage_of_block[-1] == pp - 2
    assert d.stage_of_block[0] == 0 and (d.stage_of_block[-1] == pp - 1 or head_alone)
    steps = [b - a for a, b in zip(d.stage_of_block, d.stage_of_block[1:])]
    assert set(steps) <= {0, 1}                     # contiguous, none empty
    assert len(d.stage_costs) == pp
    assert sum(d.stage_costs) == pre + sum(block_params) + post
    for s in range(pp):
        mine = sum(c for c, st in zip(block_params, d.stage_of_block) if st == s)
        assert d.stage_costs[s] == mine + (pre if s == 0 else 0) + (post if s == pp - 1 else 0)


def test_equal_blocks_split_evenly():
    d = plan_pipeline([10] * 8, 0, 0, 4, names(8))
    assert d.stage_of_block == (0, 0, 1, 1, 2, 2, 3, 3)
    assert d.stage_costs == (20, 20, 20, 20)
    assert d.blocks == names(8)


def test_pp1_everything_in_one_stage():
    d = plan_pipeline([3, 4, 5], 7, 11, 1, names(3))
    assert d.stage_of_block == (0, 0, 0) and d.stage_costs == (30,)


def test_pp_equal_to_blocks_one_block_per_stage():
    d = plan_pipeline([5, 1, 9], 2, 0, 3, names(3))
    assert d.stage_of_block == (0, 1, 2) and d.stage_costs == (7, 1, 9)


def test_heavy_head_gets_a_stage_of_its_own():
    # head = 3 blocks of 5: [5 5 | 5 5 | head 15] beats any split with a block beside it
    d = plan_pipeline([5, 5, 5, 5], 0, 15, 3, names(4))
    assert d.stage_of_block == (0, 0, 1, 1) and d.stage_costs == (10, 10, 15)
    assert d.block_range(2) == range(4, 4)


def test_heavy_embedding_shifts_blocks_to_later_stages():
    d = plan_pipeline([10] * 4, 25, 0, 2, names(4))
    assert d.stage_of_block == (0, 1, 1, 1) and d.stage_costs == (35, 30)


def test_heavy_head_shifts_blocks_to_earlier_stages():
    d = plan_pipeline([10] * 4, 0, 25, 2, names(4))
    assert d.stage_of_block == (0, 0, 0, 1) and d.stage_costs == (30, 35)


def test_heavy_embedding_and_head():
    # 8 blocks of 10, embedding and head 30 each: stages 0 and 3 get one block each
    d = plan_pipeline([10] * 8, 30, 30, 4, names(8))
    assert max(d.stage_costs) == 40
    assert d.stage_of_block.count(0) == 1 and d.stage_of_block.count(3) == 1


@pytest.mark.parametrize("seed", range(40))
def test_min_max_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    pp = rng.randint(1, n)
    block_params = [rng.randint(1, 100) for _ in range(n)]
    pre, post = rng.randint(0, 150), rng.randint(0, 150)
    d = plan_pipeline(block_params, pre, post, pp, names(n))
    check_well_formed(d, block_params, pre, post, pp)
    assert max(d.stage_costs) == brute_force(block_params, pre, post, pp)
    assert d.source == "balanced"


def test_pp_exceeding_blocks_is_a_plan_error():
    with pytest.raises(PlanError) as e:
        plan_pipeline([10] * 4, 0, 0, 5, names(4))
    assert str(e.value) == ("mesh.pp (5) exceeds the number of blocks (4) found in the model "
                            "(model.layers); use mesh.pp <= 4")


def test_pp_without_blocks_is_a_plan_error():
    with pytest.raises(PlanError) as e:
        plan_pipeline([], 10, 10, 2, ())
    assert str(e.value) == ("mesh.pp (2) exceeds the number of blocks (0) found in the model "
                            "(no nn.ModuleList); use mesh.pp <= 1")


# --- find_blocks -----------------------------------------------------------------------------

class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList(Layer(16) for _ in range(3))


class TwoLists(nn.Module):
    """A small list of heads next to the encoder's large list of layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 2) for _ in range(5))
        self.encoder = Encoder()


def test_find_blocks_picks_the_largest_module_list():
    assert find_blocks(TwoLists()) == ("encoder.layer.0", "encoder.layer.1", "encoder.layer.2")


def test_find_blocks_on_meta_device():
    with torch.device("meta"):
        model = TwoLists()
    assert find_blocks(model) == ("encoder.layer.0", "encoder.layer.1", "encoder.layer.2")


def test_find_blocks_without_module_list():
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == ()


def test_find_blocks_nested_lists_take_the_outer():
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Expert() for _ in range(2))

    assert find_blocks(MoE()) == ("blocks.0", "blocks.1")
