"""User-facing errors found by a new-user trial: each names what is wrong and the fix, and
nothing is overwritten or half-written."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from parallelizer.compiler import compile_model
from parallelizer.errors import CaptureError, CheckpointError, ModelFileError, PlanError, UserError
from parallelizer.frontend.model_file import load_model_file
from parallelizer.runtime.train import check_save_target
from parallelizer.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt"


def _model(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("pp", [1, 2])
def test_shared_buffer_written_in_place_is_refused_naming_the_line(tmp_path, pp):
    """A buffer read by every block is copied to each (the Llama 3 reference model's shared
    rotary table, tests/distributed/test_complex_pipelines.py); one the model also writes in
    place cannot be: the copies would drift apart. It failed with SplitMismatch (an internal
    error): the write-back interleaved the blocks."""
    path = _model(tmp_path, """
        import torch
        from torch import nn
        class Stats(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("shift", torch.zeros(8))
        class Block(nn.Module):
            def __init__(self, stats):
                super().__init__()
                self.lin, self.stats = nn.Linear(8, 8), stats
            def forward(self, x):
                y = x + self.lin(x) + self.stats.shift
                self.stats.shift.add_(0.5)
                return y
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                stats = Stats()
                self.layers = nn.ModuleList(Block(stats) for _ in range(4))
            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x
        def build_model():
            torch.manual_seed(0)
            return Net()
        def example_inputs():
            return (torch.randn(4, 6, 8),)
    """)
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1", f"mesh.pp={pp}"])
    with pytest.raises(PlanError) as e:
        compile_model(path, spec, weights=False)
    msg = str(e.value)
    assert msg.startswith("buffer layers.0.stats.shift is held by layers.0, layers.1, layers.2, "
                          "layers.3 as one tensor and written in place by the model "
                          "(aten.add_.Tensor at model.py:14)"), msg
    assert "give each block its own buffer" in msg
    assert msg.endswith("`for block in model.layers: block.stats = copy.deepcopy(block.stats)`; "
                        "if the blocks share its state (a counter, running statistics), keep it "
                        "outside them"), msg


def test_unserialisable_output_is_a_capture_error(tmp_path):
    """A class pytree flattens but cannot write (a NamedTuple can: tests/unit/plan/test_out_spec.py)."""
    path = _model(tmp_path, """
        import torch
        from torch import nn
        from torch.utils import _pytree
        class Out:
            def __init__(self, y):
                self.y = y
        _pytree.register_pytree_node(Out, lambda o: ([o.y], None), lambda ys, _c: Out(ys[0]))
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(8, 8)])
            def forward(self, x):
                return Out(self.layers[0](x))
        def build_model():
            return M()
        def example_inputs():
            return (torch.randn(4, 3, 8),)
    """)
    with pytest.raises(CaptureError) as e:
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=1"]))
    assert "cannot be sent between processes" in str(e.value) and "ModelOutput" in str(e.value)


@pytest.mark.parametrize("pp", [2, 1])
def test_example_batch_must_split_over_dp_and_microbatches(pp):
    """At pp = 1 the step accumulates the microbatches too: dp4 x 2 microbatches on a batch
    of 8 compiled and run.py refused it (a break test)."""
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1", "mesh.dp=2", f"mesh.pp={pp}",
                                         "pipeline.microbatches=8"])
    with pytest.raises(PlanError) as e:
        compile_model(GPT / "model.py", spec)
    msg = str(e.value)
    assert "(8)" in msg and "mesh.dp (2)" in msg and "pipeline.microbatches (8)" in msg


def test_a_non_python_model_file_is_refused():
    with pytest.raises(ModelFileError) as e:
        load_model_file(REPO / "README.md")
    assert "not a Python file" in str(e.value)


def test_output_folder_with_foreign_files_is_kept(tmp_path):
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1"])
    out = tmp_path / "out"
    program = compile_model(GPT / "model.py", spec)  # saved three times: one compile
    program.save(out)
    (out / "my_notes.md").write_text("keep")
    with pytest.raises(UserError) as e:
        program.save(out)
    assert "my_notes.md" in str(e.value)
    assert (out / "my_notes.md").read_text() == "keep" and (out / "plan.json").exists()
    (out / "my_notes.md").unlink()
    umask = os.umask(0o022)
    try:
        program.save(out)  # a plain earlier output is replaced
    finally:
        os.umask(umask)
    assert (out / "plan.json").exists()
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)  # a plain mkdir's, not mkdtemp's 0o700


# a folder no process may create files in, root included (sysfs answers EACCES / EPERM)
UNWRITABLE = Path("/sys")


@pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="needs sysfs")
def test_an_unwritable_output_is_one_clear_error(tmp_path, capsys):
    """A read-only output folder gave a raw PermissionError traceback (exit 1) from the
    compile and every conversion, and run.py --save failed only after training (a break
    test): now one error line each, exit 2; run.py's before any step."""
    from parallelizer.cli.parallelize import main
    from parallelizer.runtime.main import _parser, _periodic_args_error
    assert main([str(GPT / "model.py"), str(GPT / "spec.yaml"), "-o", str(UNWRITABLE / "pz-out"),
                 "mesh.tp=1", "--no-weights"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {UNWRITABLE}/.pz-out.tmp-") and \
        "nothing was published" in err and "Traceback" not in err, err
    for flag in ("--save", "--log-dir"):
        error = _periodic_args_error(_parser().parse_args(
            ["--train", flag, str(UNWRITABLE / "pz-run" / "ck")]))
        assert error.startswith(f"{flag} {UNWRITABLE}/pz-run/ck: cannot write into {UNWRITABLE} ("), error


def test_cli_refuses_a_foreign_output_folder_before_compiling(tmp_path, capsys, monkeypatch):
    """The CLI checks -o first: a refusal costs no compile (the model is never built)."""
    from parallelizer.cli.parallelize import main
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    model = tmp_path / "model.py"
    model.write_text("def build_model():\n    raise AssertionError('built')\n"
                     "def example_inputs():\n    raise AssertionError('called')\n")
    assert main([str(model), str(GPT / "spec.yaml"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: output folder {out} holds files parallelizer did not write (notes.txt)" in err
    assert (out / "notes.txt").read_text() == "keep"


def test_save_never_replaces_foreign_files_or_a_program(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "weights.bin").write_text("x")
    with pytest.raises(UserError, match="not a parallelizer checkpoint"):
        check_save_target(mine)
    prog = tmp_path / "prog"
    (prog / "checkpoint").mkdir(parents=True)
    (prog / "plan.json").write_text("{}")
    (prog / "checkpoint" / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="compiled program"):
        check_save_target(prog)
    with pytest.raises(UserError, match="compiled program"):
        check_save_target(prog / "checkpoint")
    old = tmp_path / "old_ckpt"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    check_save_target(old)  # an earlier checkpoint may be replaced
    check_save_target(tmp_path / "new")


@pytest.fixture(scope="module")
def no_weights_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("nw") / "out"
    compile_model(GPT / "model.py", load_spec(GPT / "spec.yaml", ["mesh.tp=1"]), weights=False).save(out)
    return out


def test_save_replaces_only_a_checkpoint_of_the_same_model(no_weights_out, tmp_path):
    """run.py --save DIR over another model's checkpoint (with its optimizer state) replaced
    it silently (a break test); now refused, naming what it holds; one of this program's
    model (its tensors, optimizer state aside, any layout) may still be replaced."""
    import json
    from parallelizer.plan.parallel_plan import ParallelPlan
    plan = ParallelPlan.from_json((no_weights_out / "plan.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps(
        {"tensors": {"blocks.0.down.bias": {}, "optim.blocks.0.down.bias.exp_avg": {}}}))
    with pytest.raises(UserError) as e:
        check_save_target(other, plan)
    assert str(e.value).startswith(f"--save {other}: that folder is a checkpoint of another "
                                   f"model (it holds blocks.0.down.bias and lacks "), str(e.value)
    assert "optim." not in str(e.value)
    same = tmp_path / "same"
    same.mkdir()
    (same / "manifest.json").write_text(json.dumps({"tensors": {
        **dict.fromkeys(plan.tensors, {}), **{f"optim.{n}.exp_avg": {} for n in plan.tensors}}}))
    check_save_target(same, plan)


def test_verify_without_a_reference_is_one_clear_error(no_weights_out):
    p = subprocess.run([sys.executable, str(no_weights_out / "run.py"), "--verify", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no reference.safetensors" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_clear_error(no_weights_out):
    p = subprocess.run([sys.executable, str(no_weights_out / "run.py"), "--train", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "CUDA is not available" in p.stderr


def test_no_weights_compile_does_not_need_a_divisible_example_batch(tmp_path):
    """Without weights there is no reference to verify, so the example batch (the 70B
    example's is 2) need not split over dp x microbatches."""
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1", "mesh.dp=2", "mesh.pp=2",
                                         "pipeline.microbatches=8"])
    program = compile_model(GPT / "model.py", spec, weights=False)
    assert program.state is None and program.reference is None


def test_missing_checkpoint_path_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1", "checkpoint.path=weights/nowhere"])
    with pytest.raises(CheckpointError) as e:
        compile_model(GPT / "model.py", spec)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.path: Hugging Face checkpoint {tmp_path}/weights/nowhere "
                          "does not exist"), msg
    assert "relative to the spec file's folder; given as an override, to the current directory" in msg


def test_negative_steps_is_refused(capsys):
    """--steps -1 used to train nothing and exit 0, silently."""
    from parallelizer.runtime.main import _parser
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--train", "--steps", "-1"])
    assert e.value.code == 2
    assert "argument --steps: expected an integer >= 0, got '-1'" in capsys.readouterr().err
    assert _parser().parse_args(["--train", "--steps", "0"]).steps == 0


# a 0-dim output beside the batch-shaped one; loss_fn returns that output itself
_LOSS_IS_AN_OUTPUT = """
    import torch
    from torch import nn
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x, x.pow(2).mean()
    def build_model():
        torch.manual_seed(0)
        return Net()
    def example_inputs():
        return (torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0)),)
    def loss_fn(outputs, batch):
        return outputs[1]
"""


def test_loss_that_is_an_output_and_a_0_dim_output(tmp_path):
    """``loss_fn`` returning an output (HF ``outputs.loss``) made loss and output.N share memory,
    and safetensors refused to save reference.safetensors. The 0-dim output has no batch dim:
    --verify compares it only when the step runs the batch whole (dp = pp = 1)."""
    from safetensors.torch import load_file

    from parallelizer.plan.parallel_plan import ParallelPlan
    from parallelizer.runtime.verify import _output_share
    path = _model(tmp_path, _LOSS_IS_AN_OUTPUT)
    out = tmp_path / "out"
    compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=1", "mesh.pp=1"])).save(out)
    ref = load_file(str(out / "reference.safetensors"))
    assert ref["output.1"].shape == () and torch.equal(ref["loss"], ref["output.1"])

    def plan(dp, pp):
        return ParallelPlan(mesh={"pp": pp, "dp": dp, "tp": 1}, zero_stage=0, schedule="1F1B",
                            microbatches=2, seed=0, tensors={}, aliases={}, stages=())
    assert torch.equal(_output_share(ref["output.0"], 4, plan(2, 1), 1), ref["output.0"][2:])
    assert torch.equal(_output_share(ref["output.1"], 4, plan(1, 1), 0), ref["output.1"])
    assert _output_share(ref["output.1"], 4, plan(2, 1), 0) is None
    assert _output_share(ref["output.1"], 4, plan(1, 2), 0) is None


def test_output_without_batch_dim_is_refused_under_pp(tmp_path):
    """torch.distributed.pipelining concatenates outputs over microbatches on dim 0: an
    output without the batch dim failed in the first step on every rank; now a compile
    error naming it. A 0-dim floating-point output (a loss) is averaged instead, so the
    model with one compiles."""
    path = _model(tmp_path, _LOSS_IS_AN_OUTPUT.replace("x.pow(2).mean()", "x.pow(2).mean((0, 1))"))
    spec = load_spec(GPT / "spec.yaml", ["mesh.tp=1", "mesh.pp=2", "pipeline.microbatches=2"])
    with pytest.raises(PlanError) as e:
        compile_model(path, spec, weights=False)
    msg = str(e.value)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1)
                if "x.pow(2).mean((0, 1))" in t)
    assert msg.startswith(f"output 1 (outputs[1]) of the model (made by aten.mean.dim at "
                          f"model.py:{line}) has shape [8] (torch.float32), without the batch "
                          f"dim"), msg
    assert "return per-sample values and reduce them in loss_fn" in msg and "mesh.pp=1" in msg
    assert "leave the output out (a config flag that adds it: transformers' " \
        "output_router_logits" in msg, msg
    # a dict (a ModelOutput) names the output by its key: Mixtral's router_logits
    keyed = _LOSS_IS_AN_OUTPUT.replace("return x, x.pow(2).mean()",
                                       "return {'x': x, 'stats': x.pow(2).mean((0, 1))}")
    with pytest.raises(PlanError, match=r"^output 1 \(outputs\['stats'\]\) of the model"):
        compile_model(_model(tmp_path, keyed.replace("outputs[1]", "outputs['x'].mean()")),
                      spec, weights=False)
    plan = compile_model(_model(tmp_path, _LOSS_IS_AN_OUTPUT), spec, weights=False).plan
    assert plan.scalar_outputs == (1,)




def test_loss_fn_raising_at_compile_is_a_model_file_error_naming_its_line(tmp_path):
    """The compile's reference step calls loss_fn: a bug in it is one error naming model.py's
    line, not a traceback (exit 2 from the CLI)."""
    source = (GPT / "model.py").read_text().replace("F.cross_entropy(", "F.cross_entropi(")
    assert "F.cross_entropi(" in source
    path = tmp_path / "model.py"
    path.write_text(source)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "F.cross_entropi(" in text)
    with pytest.raises(ModelFileError) as e:
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=1"]))
    msg = str(e.value)
    assert msg.startswith(f"loss_fn(outputs, batch) in {path} raised AttributeError"), msg
    assert f"{path}:{line}" in msg and "the reference step" in msg, msg


def test_loss_fn_returning_no_scalar_is_a_model_file_error(tmp_path):
    source = (GPT / "model.py").read_text() + "\n\ndef loss_fn(outputs, batch):\n    return outputs\n"
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(ModelFileError, match=r"loss_fn\(outputs, batch\) in .* must return one "
                                             r"floating-point number as a tensor .* got \(8, 16, 96\)"):
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=1"]))


def test_an_output_folder_run_py_logged_into_is_refused_as_such(tmp_path):
    """OUT/logs/ is run.py --train's (its default --log-dir): a compile into that OUT is
    refused, keeping the logs, without claiming parallelizer did not write them (it said
    'holds files parallelizer did not write (logs)': a new-user break test)."""
    from parallelizer.emit.program import check_replaceable
    out = tmp_path / "out"
    compile_model(GPT / "model.py", load_spec(GPT / "spec.yaml", ["mesh.tp=1"])).save(out)
    (out / "logs").mkdir()
    (out / "logs" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError) as e:
        check_replaceable(out)
    assert str(e.value) == (f"output folder {out} holds logs/ that run.py wrote there (--train's "
                            f"metrics, loss curve, TensorBoard events); compiling again replaces "
                            f"OUT whole, so move it away first, or choose another -o")
    assert (out / "logs" / "metrics.jsonl").read_text() == "{}\n"


class _ReluWrittenInPlace(torch.nn.Module):
    """Blocks that multiply a slice of a ReLU's output in place: autograd refuses the
    backward of the model as it is ("modified by an inplace operation")."""

    def __init__(self, d=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            h = block(x).relu()
            h[..., :x.shape[-1]].mul_(2.0)
            x = x + h[..., :x.shape[-1]]
        return x


def test_a_model_whose_own_backward_fails_is_named_not_called_a_parallelizer_bug():
    """At pp2 the compile's rank check met the model's own backward failure and called it
    "internal error (a bug in parallelizer) ...; compile with mesh.tp=1 meanwhile" (a break
    test). A failing compile check now first runs the model as it is: its own failure is the
    user's error, with the fix line."""
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}})
    with pytest.raises(CaptureError, match=r"fails on example_inputs\(\) when it runs as it is, "
                                           r"without parallelizer: RuntimeError: one of the "
                                           r"variables needed for gradient computation"):
        compile_module(_ReluWrittenInPlace(), (torch.randn(4, 3, 8),), spec, reference=False)


class _BatchNormToOnePixel(torch.nn.Module):
    """Strided convs with BatchNorm in training mode down to a 1x1 map (LeViT's strided
    query): one sample gives BatchNorm one value per channel, which torch refuses."""

    def __init__(self, c=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Conv2d(c, c, 3, stride=2, padding=1), torch.nn.BatchNorm2d(c))
            for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return x


def test_a_model_failing_on_one_microbatch_names_the_share_not_a_parallelizer_bug():
    """LeViT at pp2 with 4 microbatches of a batch of 4 (zoo 11 F7): the rank check's one
    sample failed in BatchNorm and the compile said "internal error (a bug in parallelizer)
    ...; compile with mesh.tp=1 meanwhile", at tp 1. The model as it is fails on that share
    too: the refusal names the share, the model's error and line, and the fix."""
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    spec = Spec.model_validate({"mesh": {"pp": 2}, "pipeline": {"microbatches": 4}})
    with pytest.raises(PlanError) as e:
        compile_module(_BatchNormToOnePixel(), (torch.randn(4, 4, 4, 4),), spec)
    msg = str(e.value)
    assert msg.startswith("the model fails on 1 sample(s) at a time, the share of the example "
                          "batch of 4 that one stage runs under mesh.dp x pipeline.microbatches "
                          "= 4, without parallelizer too: ValueError: Expected more than 1 "
                          "value per channel when training"), msg
    assert "test_user_errors.py" in msg and "internal error" not in msg, msg
    assert msg.endswith("Fix: fewer microbatches or dp ranks, or a larger example batch in "
                        "example_inputs()"), msg
    compile_module(_BatchNormToOnePixel(), (torch.randn(8, 4, 4, 4),), spec, reference=False)


def test_a_module_whose_submodules_cannot_be_listed_is_a_model_file_error(tmp_path):
    """nGPT-pytorch 0.2 defines ``__eq__`` without ``__hash__`` on its modules, so
    ``named_modules`` (a set of the modules seen) raises "unhashable type": the compile died
    with a raw traceback, exit 1 (zoo 13 Z5)."""
    path = _model(tmp_path, """
        import torch
        from torch import nn
        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
            def __eq__(self, other):  # defines __eq__, so Python drops __hash__
                return self is other
            def forward(self, x):
                return self.fc(x)
        def build_model():
            return nn.Sequential(Scale(), Scale())
        def example_inputs():
            return (torch.randn(4, 5, 8),)
    """)
    with pytest.raises(ModelFileError) as e:
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=2"]))
    assert str(e.value).startswith(
        f"build_model() in {path} returned a module whose submodules cannot be listed "
        f"(Module.named_modules): TypeError: unhashable type: 'Scale' (a module class "
        f"defining __eq__ without __hash__"), e.value
    assert "give such classes __hash__ = torch.nn.Module.__hash__" in str(e.value)


_CACHE_PASSED_TO_BLOCKS = """
import torch, torch.nn as nn

class Table(nn.Module):
    '''A table cached into a buffer by its first call, read by the later ones
    (rotary-embedding-torch's cache_if_possible).'''
    def __init__(self):
        super().__init__()
        self.register_buffer("cached", torch.zeros(16, 8), persistent=False)
        self.freqs = nn.Parameter(torch.arange(8.0) / 8, requires_grad=False)
        self.filled = False
    def forward(self, n):
        if self.filled:
            return self.cached[READ].detach()
        table = (torch.arange(n)[:, None] * self.freqs).sin()
        self.cached[:n] = table.detach()
        self.filled = True
        return table

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x, table):
        return x + self.fc(x * table(x.shape[1]))

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = Table()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
    def forward(self, x):
        for b in self.blocks:
            x = b(x, self.table)
        return x

def build_model():
    torch.manual_seed(0)
    return M()

def example_inputs():
    return (torch.randn(4, 6, 8),)
"""


def test_a_buffer_written_in_one_stage_and_read_in_another_is_refused(tmp_path):
    """nGPT-pytorch hands one rotary-embedding-torch module, held outside the blocks, to
    every layer; its first call caches the table into a buffer and the later ones read it.
    At pp2 the second stage read its own copy's initial zeros: a wrong program, stopped only
    by the self-check as an internal error (zoo 13 Z18). A read of the region written takes
    the written table (frontend/buffer_reads.py): that model compiles at pp2 and its stages
    equal it (the self-check). A read of another region is refused naming the buffer and
    the write's line; at pp1 it compiles."""
    (tmp_path / "same").mkdir()
    same = _model(tmp_path / "same", _CACHE_PASSED_TO_BLOCKS.replace("READ", ":n"))
    program = compile_model(same, load_spec(GPT / "spec.yaml", ["mesh.pp=2", "mesh.tp=1"]))
    assert any(n.startswith("self-check: 1 tp rank(s)") for n in program.notes), program.notes
    path = _model(tmp_path, _CACHE_PASSED_TO_BLOCKS.replace("READ", "1:n + 1"))
    with pytest.raises(PlanError) as e:
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.pp=2", "mesh.tp=1"]))
    assert str(e.value).startswith(
        "buffer table.cached is written in place by the model (aten.copy_.default at "
        "model.py:16) in pipeline stage 0 and read in stage 1, which holds its own copy and "
        "never sees the write"), e.value
    assert "or use mesh.pp=1" in str(e.value)
    compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.pp=1", "mesh.tp=1"]))


def test_more_stages_than_blocks_names_a_block_forward_runs_several_times(tmp_path):
    """ALBERT runs its one layer group ``num_hidden_layers`` times with the same weights. At
    pp2 the refusal counted one block and said nothing of the two layers the model runs
    (zoo 14 F8); it now names the block and how often forward runs it."""
    path = _model(tmp_path, """
        import torch
        from transformers import AlbertConfig, AlbertForMaskedLM
        def build_model():
            torch.manual_seed(0)
            return AlbertForMaskedLM(AlbertConfig(
                vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                num_hidden_groups=1, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=16))
        def example_inputs():
            return {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    """)
    with pytest.raises(PlanError) as e:
        compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=1", "mesh.pp=2"]), weights=False)
    assert "mesh.pp (2) exceeds the number of blocks (1) found in the model " \
           "(albert.encoder.albert_layer_groups); use mesh.pp <= 1. Forward runs " \
           "albert.encoder.albert_layer_groups.0 (2 times) with the same weights: stages are " \
           "cut between modules, not between calls of one module" in str(e.value), str(e.value)
