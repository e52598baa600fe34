"""The Python API inside a user's own training loop (examples/api_train.py) equals
single-device training of the same model with the same AdamW and LR scheduler; and the
API's launch errors."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import parallelizer as pz
from parallelizer.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "api_train.py"
STEP = re.compile(r"^step (\d+) loss (\S+) lr (\S+) norm (\S+)$", re.M)


def _run(tools, nproc: int | None, *args: str):
    """``python examples/api_train.py ARGS`` (nproc None) or under torchrun with nproc ranks."""
    return tools.launch(SCRIPT, nproc, *args, timeout=300).wait()


def _losses(p) -> list[tuple[float, float, float]]:
    assert p.code == 0, p.explain()
    return [(float(loss), float(lr), float(norm)) for _, loss, lr, norm in STEP.findall(p.stdout)]


@pytest.fixture(scope="module")
def single_device(tools) -> list[tuple[float, float]]:
    out = _losses(_run(tools, None, "--single"))
    assert len(out) == 3
    return out


@pytest.mark.timeout(300)
# the pp case runs ZB-V: two stages per rank, the tied embedding and LM head on one rank
@pytest.mark.parametrize("mesh", [("mesh.tp=2", "mesh.pp=2", "mesh.dp=1", "pipeline.schedule=zbv",
                                   "pipeline.virtual_stages=2"),
                                  ("mesh.dp=2", "mesh.tp=2", "mesh.pp=1")])
def test_api_training_equals_single_device(mesh, single_device, tmp_path, tools):
    save = ("--save", str(tmp_path / "ckpt")) if "mesh.dp=2" in mesh else ()
    p = _run(tools, 4, *mesh, *save)
    got = _losses(p)
    if save:  # pm.save_checkpoint: one file per rank, equal to the explicit gather
        assert "saved checkpoint equals full_state_dict: True" in p.stdout, p.stdout
        assert sorted(f.name for f in (tmp_path / "ckpt").glob("*.safetensors")) == [
            f"pp0-tp{t}-dp{d}.safetensors" for t in (0, 1) for d in (0, 1)]
    assert "ParallelModule(mesh" in p.stdout
    assert len(got) == 3
    for step, ((loss, lr, norm), (ref_loss, ref_lr, ref_norm)) in enumerate(zip(got, single_device), 1):
        print(f"{' '.join(mesh)} step {step}: loss {loss} vs {ref_loss} (lr {lr}), "
              f"pm.clip_grad_norm_ {norm} vs torch's {ref_norm}")
        assert lr == ref_lr
        assert abs(loss - ref_loss) <= 1e-5, (step, loss, ref_loss)
        # the global norm, every parameter once (a per-stage or per-shard norm is far off)
        assert ref_norm > 0.5 and abs(norm - ref_norm) <= 1e-6, (step, norm, ref_norm)


@pytest.mark.timeout(300)
def test_api_world_size_mismatch_is_one_clear_error(tools):
    p = _run(tools, 2, "mesh.tp=2", "mesh.pp=2", "mesh.dp=1")
    assert p.code != 0
    assert "the spec's mesh needs 4 ranks but the world size is 2" in p.stderr
    assert "torchrun --nproc-per-node 4" in p.stderr


def test_api_outside_a_process_group_says_what_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    spec = pz.load_spec(REPO / "examples" / "llama" / "spec.yaml", ["mesh.tp=2"])
    with pytest.raises(UserError) as e:
        pz.parallelize(torch.nn.Linear(4, 4), spec, example_inputs=(torch.zeros(2, 4),))
    msg = str(e.value)
    assert "no process group is initialised" in msg
    assert "torchrun --nproc-per-node 2" in msg


def test_api_compile_then_save_matches_the_cli_layout(tmp_path):
    """pz.compile + Program.save writes the same kind of OUT/ as the CLI, without touching
    the user's model (the reference step runs on a copy)."""
    import importlib.util
    spec_file = REPO / "examples" / "gpt" / "model.py"
    mod_spec = importlib.util.spec_from_file_location("gpt_example_api", spec_file)
    gpt = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(gpt)
    model = gpt.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = pz.load_spec(REPO / "examples" / "gpt" / "spec.yaml", ["mesh.tp=2"])
    program = pz.compile(model, spec, example_inputs=gpt.example_inputs(), loss_fn=gpt.loss_fn)
    program.save(tmp_path / "out")
    for name in ("run.py", "plan.json", "program/stage0.py", "checkpoint/manifest.json",
                 "checkpoint/pp0-tp1.safetensors", "reference.safetensors"):
        assert (tmp_path / "out" / name).exists(), name
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified"


def test_api_wrong_argument_types_are_user_errors():
    """A dict spec, a string of overrides or non-tensor inputs were a TypeError or
    AttributeError deep inside; each is now one UserError naming the argument and the fix."""
    spec_yaml = REPO / "examples" / "llama" / "spec.yaml"
    with pytest.raises(UserError, match=r"overrides must be a list .* pass \['mesh.tp=2'\]"):
        pz.load_spec(spec_yaml, overrides="mesh.tp=2")
    spec, x = pz.load_spec(spec_yaml), torch.zeros(2, 4)
    for bad_spec in ({"mesh": {"tp": 2}}, None):
        for call in (pz.compile, pz.parallelize):
            with pytest.raises(UserError, match="spec must be a parallelizer Spec, got (dict|NoneType); "
                                                r"build it with pz.load_spec\("):
                call(torch.nn.Linear(4, 4), bad_spec, example_inputs=(x,))
    for bad, seen in ((None, "NoneType"), ((x, 3), "Tensor, int"), ({}, "nothing")):
        with pytest.raises(UserError, match=f"example_inputs must be a tensor, or a tuple or dict of "
                                            f"tensors .*; got {seen}$"):
            pz.compile(torch.nn.Linear(4, 4), spec, example_inputs=bad)


def test_pz_clip_grad_norm_takes_a_parallel_module():
    with pytest.raises(UserError, match=r"pz.clip_grad_norm_ takes the ParallelModule .* got Linear; "
                                        r"for a plain module use torch.nn.utils.clip_grad_norm_"):
        pz.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)
