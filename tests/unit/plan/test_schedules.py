"""Pipeline schedules by name: the installed torch's classes, stage placement, the spec's
compile-time checks (each message names the keys and the numbers), the theoretical bubble,
the measured-bubble arithmetic, and checkpoint files per stage."""
import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from parallelizer.checkpoint import load_shard, write_checkpoint
from parallelizer.planning.spec_checks import num_stages_of
from parallelizer.errors import CheckpointError, PlanError, SpecError
from parallelizer.plan.schedules import (TORCH_NAMES, available, schedule_class, stage_ranks,
                                         bubble, check, compute_actions, with_schedule)
from parallelizer.plan.parallel_plan import ParallelPlan, StagePlan, TensorPlan
from parallelizer.runtime.bubble import busy_time
from parallelizer.frontend.spec import load_spec

EXPECTED = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
            "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
            "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def test_every_name_maps_to_the_installed_torch_class():
    assert set(TORCH_NAMES) == set(EXPECTED)
    assert available() == list(TORCH_NAMES)  # torch 2.13 has all of them
    for name, cls in EXPECTED.items():
        assert schedule_class(name) is getattr(torch_schedules, cls)
    assert schedule_class("zerobubble") is None


def test_loop_and_v_placement_match_torch():
    assert stage_ranks("1f1b", 4, 1) == (0, 1, 2, 3)
    assert stage_ranks("interleaved_1f1b", 2, 2) == (0, 1, 0, 1)
    assert stage_ranks("zbv", 2, 2) == (0, 1, 1, 0)
    assert stage_ranks("dualpipev", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    for style, name in (("loop", "looped_bfs"), ("v", "zbv")):
        want = torch_schedules.generate_stage_to_rank_mapping(4, 8, style=style)
        assert stage_ranks(name, 4, 2) == tuple(want[s] for s in range(8))


def test_action_lists_are_torchs_visualizer_ones():
    """compute_actions builds each schedule on plain stand-in stages (plan/schedules.py
    _Stage); torch's get_schedule_ops, on its autospec mock of PipelineStage, gives the same
    actions for every schedule, at 1 to 3 stages per rank and microbatch counts below, at
    and above pp."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    seen = set()
    for name in available():
        single = issubclass(schedule_class(name), torch_schedules.PipelineScheduleSingle)
        for pp, v, m in [(2, 1, 1), (2, 2, 2), (2, 2, 4), (3, 2, 6), (4, 1, 5), (4, 2, 8), (2, 3, 6)]:
            v = 1 if single else v
            if (v < 2 and not single) or check(name, pp, v, m) is not None:
                continue
            want = [[(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                     for a in actions if a is not None for a in (a.sub_actions or (a,))
                     if a.computation_type.name in kinds]
                    for actions in get_schedule_ops(schedule_class(name), pp, m, None if single else v)]
            assert compute_actions(name, pp, v, m) == want, (name, pp, v, m)
            seen.add(name)
    assert seen == set(available())


def _spec(tmp_path, *overrides):
    path = tmp_path / "spec.yaml"
    path.write_text("mesh: {pp: 2}\npipeline: {microbatches: 4}\n")
    return load_spec(path, list(overrides))


def _spec_error(tmp_path, *overrides) -> str:
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, *overrides)
    return str(e.value)


def test_valid_combinations_load(tmp_path):
    for name, v in (("gpipe", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2),
                    ("interleaved_zero_bubble", 1), ("interleaved_zero_bubble", 2), ("zbv", 2),
                    ("dualpipev", 2)):
        spec = _spec(tmp_path, f"pipeline.schedule={name}", f"pipeline.virtual_stages={v}")
        assert (spec.pipeline.schedule, spec.pipeline.virtual_stages) == (name, v)


@pytest.mark.parametrize("overrides, needles", [
    (("pipeline.schedule=zero_bubble",),
     ["pipeline.schedule 'zero_bubble'", "torch 2.13", "'gpipe'", "'dualpipev'"]),
    (("pipeline.schedule=gpipe", "pipeline.virtual_stages=2"),
     ["'gpipe' runs one stage per rank", "pipeline.virtual_stages is 2"]),
    (("pipeline.schedule=interleaved_1f1b",),
     ["'interleaved_1f1b' needs pipeline.virtual_stages >= 2 (got 1)", "use 1f1b"]),
    (("pipeline.schedule=zbv", "pipeline.virtual_stages=3"),
     ["'zbv' needs exactly 2 stages per rank", "pipeline.virtual_stages=2 (got 3)"]),
    (("pipeline.schedule=dualpipev", "pipeline.virtual_stages=2", "pipeline.microbatches=3"),
     ["pipeline.microbatches (3) must be >= the number of stages 2 * mesh.pp = 4"]),
    (("pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.microbatches=5"),
     ["pipeline.microbatches (5) must be a multiple of the number of rounds", "= 2", "e.g. 4"]),
    (("mesh.pp=1", "pipeline.virtual_stages=2"),
     ["pipeline.virtual_stages (2) needs mesh.pp > 1"]),
    (("pipeline.virtual_stages=0",), ["pipeline.virtual_stages must be an integer >= 1"]),
    (("pipeline.microbatches=1",),
     ["pipeline.microbatches (1) must be >= mesh.pp (2) for schedule '1f1b'",
      "set pipeline.microbatches=2 or more"]),
])
def test_schedule_constraints_are_spec_errors(tmp_path, overrides, needles):
    msg = _spec_error(tmp_path, *overrides)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert "gpipe" not in msg or "gpipe" in " ".join(overrides) + " ".join(needles), msg


def test_zero_bubble_with_every_zero_stage_over_dp_is_allowed(tmp_path):
    # FSDP2 (2, 3) included: tests/distributed/test_zero_matrix.py trains them like eager
    for z in range(4):
        spec = _spec(tmp_path, "pipeline.schedule=dualpipev", "pipeline.virtual_stages=2",
                     "mesh.dp=2", f"zero_stage={z}")
        assert spec.zero_stage == z


def test_more_stages_than_blocks_is_a_plan_error(tmp_path):
    spec = _spec(tmp_path, "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=3")
    assert num_stages_of(spec, ("l.0", "l.1", "l.2", "l.3", "l.4", "l.5")) == 6
    with pytest.raises(PlanError, match=r"mesh.pp \(2\) x pipeline.virtual_stages \(3\) = 6 "
                                        r"stages exceeds the number of blocks \(4\)"):
        num_stages_of(spec, ("l.0", "l.1", "l.2", "l.3"))


def test_theoretical_bubble():
    assert bubble("1f1b", 4, 8, 1, upper_bound=False) == pytest.approx(3 / 11)
    assert bubble("gpipe", 2, 4, 1, upper_bound=False) == pytest.approx(1 / 5)
    assert bubble("interleaved_1f1b", 2, 4, 2, upper_bound=False) == pytest.approx(1 / 9)
    assert bubble("looped_bfs", 4, 8, 2, upper_bound=False) == pytest.approx(3 / 19)
    assert bubble("zbv", 2, 4, 2, upper_bound=False) is None
    assert bubble("1f1b", 1, 4, 1, upper_bound=False) == 0.0


def test_busy_time_merges_overlapping_intervals():
    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)
    assert busy_time([(2.0, 3.0), (0.0, 1.5), (1.0, 2.5)]) == pytest.approx(3.0)
    assert busy_time([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)


def _plan(schedule: str, pp: int, v: int, microbatches: int = 4, dp: int = 1, zero_stage: int = 0):
    n = pp * v
    ranks = stage_ranks(schedule, pp, v)
    tensors = {"embed.weight": TensorPlan("embed.weight", (6, 4), "float32", 0, (0, n - 1)),
               **{f"layers.{s}.w": TensorPlan(f"layers.{s}.w", (4, 4), "float32", None, (s,))
                  for s in range(n)}}
    stages = tuple(StagePlan(s, f"stage{s}", (), (), (), (), ranks[s]) for s in range(n))
    # equal blocks, light embedding and head (cost-model units: 0 before, 1 + s, n + 1 after):
    # the partitioner puts one block per stage, as these stages do
    structure = {"blocks": [f"layers.{s}" for s in range(n)], "block_costs": [16] * n,
                 "pre_cost": 1, "post_cost": 1,
                 "uses": {"embed.weight": [0, n + 1], **{f"layers.{s}.w": [s + 1] for s in range(n)}},
                 "state_dict_keys": list(tensors) + ["head.weight"]}
    return ParallelPlan(mesh={"pp": pp, "dp": dp, "tp": 2}, zero_stage=zero_stage,
                        schedule=schedule, microbatches=microbatches, seed=0, tensors=tensors,
                        aliases={"head.weight": "embed.weight"}, stages=stages, virtual_stages=v,
                        structure=structure)


def test_with_schedule_replaces_stages_and_keeps_the_layout():
    plan = _plan("interleaved_1f1b", 2, 2)
    v = with_schedule(plan, "zbv")
    assert v.schedule == "zbv" and [st.rank for st in v.stages] == [0, 1, 1, 0]
    assert v.local_stages(0) == [0, 3] and v.local_stages(1) == [1, 2]
    assert v.hash() == plan.hash()  # the same checkpoint serves both placements
    assert ParallelPlan.from_json(v.to_json()) == v
    with pytest.raises(PlanError, match=r"cannot run schedule 'gpipe'.*pipeline.virtual_stages is 2"):
        with_schedule(plan, "gpipe")
    fsdp = with_schedule(_plan("interleaved_1f1b", 2, 2, dp=2, zero_stage=3), "dualpipev")
    assert fsdp.local_stages(0) == [0, 3]  # zero-bubble over FSDP2 runs (test_zero_matrix.py)


def test_checkpoint_has_one_file_per_stage(tmp_path):
    plan = _plan("interleaved_1f1b", 2, 2)
    g = torch.Generator().manual_seed(0)
    state = {fqn: torch.randn(t.shape, generator=g) for fqn, t in plan.tensors.items()}
    write_checkpoint(state, plan, tmp_path / "ckpt")
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert names == [f"pp{s}-tp{t}.safetensors" for s in range(4) for t in range(2)]
    last = load_shard(tmp_path / "ckpt", 3, 1, plan)
    assert sorted(last) == ["embed.weight", "layers.3.w"]
    assert torch.equal(last["embed.weight"], state["embed.weight"][3:6])
    assert torch.equal(last["layers.3.w"], state["layers.3.w"])
    with pytest.raises(CheckpointError, match=r"\(stage 4, tp 0\) is outside the checkpoint's 4 stages"):
        load_shard(tmp_path / "ckpt", 4, 0, plan)


def test_checkpoint_with_optimizer_state_per_stage_and_reshard(tmp_path):
    """The manifest records num_stages; AdamW state is stored in each stage file its
    parameter is in (the tied embedding in stages 0 and 3); reshard to another tp keeps the
    4 stages bit-exactly; another pp without --plan is refused, naming the manifest."""
    from parallelizer.checkpoint.reader import check_plan, read_manifest
    from parallelizer.convert.reshard import reshard
    plan = _plan("zbv", 2, 2)
    g = torch.Generator().manual_seed(0)
    state = {fqn: torch.randn(t.shape, generator=g) for fqn, t in plan.tensors.items()}
    optim = {fqn: {"exp_avg": torch.randn(t.shape, generator=g),
                   "exp_avg_sq": torch.rand(t.shape, generator=g), "step": torch.tensor(3.0)}
             for fqn, t in plan.tensors.items()}
    src = write_checkpoint(state, plan, tmp_path / "ckpt", optim_state=optim,
                           train={"step": 3, "optimizer": "adamw"})
    manifest = read_manifest(src)
    assert manifest["num_stages"] == 4 and manifest["mesh"]["pp"] == 2
    check_plan(src, manifest, plan)
    check_plan(src, manifest, _plan("gpipe", 4, 1))  # files are per stage: 4 x 1 == 2 x 2
    with pytest.raises(CheckpointError, match=r"checkpoint mesh pp=2 tp=2 \(4 stages, 2 per rank\), "
                                              r"this program pp=2 tp=2; tensors only in the plan: \[\], only in the "
                                              r"checkpoint: \[.layers.2.w., .layers.3.w.\]"):
        check_plan(src, manifest, _plan("gpipe", 2, 1))
    for s in (0, 3):
        opt = load_shard(src, s, 1, plan, optim=True)
        assert torch.equal(opt["optim.embed.weight.exp_avg"], optim["embed.weight"]["exp_avg"][3:6])
        assert torch.equal(opt["optim.embed.weight.step"], torch.tensor(3.0))
        assert f"optim.layers.{s}.w.exp_avg_sq" in opt and "optim.layers.1.w.step" not in opt

    reshard(src, tmp_path / "tp1", tp=1)
    names = sorted(p.name for p in (tmp_path / "tp1").glob("*.safetensors"))
    assert names == [f"pp{s}-tp0.safetensors" for s in range(4)]
    assert read_manifest(tmp_path / "tp1")["num_stages"] == 4
    for s in range(4):
        shard = load_shard(tmp_path / "tp1", s, 0)
        assert torch.equal(shard[f"layers.{s}.w"], state[f"layers.{s}.w"])
        if s in (0, 3):
            assert torch.equal(shard["embed.weight"], state["embed.weight"])
            opt = load_shard(tmp_path / "tp1", s, 0, optim=True)
            assert torch.equal(opt["optim.embed.weight.exp_avg_sq"], optim["embed.weight"]["exp_avg_sq"])

    # another pp from 2 stages per rank: the partitioner re-cuts the blocks (1 stage per rank
    # by default); --virtual-stages goes back to 2 per rank, bit-exact and loadable by plan
    reshard(src, tmp_path / "pp4", pp=4)
    m4 = read_manifest(tmp_path / "pp4")
    assert m4["mesh"]["pp"] == 4 and m4["num_stages"] == 4
    check_plan(tmp_path / "pp4", m4, _plan("gpipe", 4, 1))
    reshard(tmp_path / "pp4", tmp_path / "pp2v2", pp=2, virtual_stages=2)
    m22 = read_manifest(tmp_path / "pp2v2")
    assert m22["mesh"]["pp"] == 2 and m22["num_stages"] == 4
    check_plan(tmp_path / "pp2v2", m22, plan)
    for s in range(4):
        for t in range(2):
            want, got = load_shard(src, s, t, plan), load_shard(tmp_path / "pp2v2", s, t, plan)
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
