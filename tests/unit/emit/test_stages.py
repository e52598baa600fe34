"""The emitted program, single process: compile an example, save OUT/, import the emitted
stage source, load OUT/checkpoint and compare with the unmodified model.

At tp=1 the Megatron f/g operators are identities (no tp process group is set), so no
process group is needed. Parameter names of the emitted modules are the original FQNs.
"""
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parallelizer.checkpoint.reader import load_full
from parallelizer.compiler import compile_model
from parallelizer.frontend.model_file import load_model_file
from parallelizer.plan.layouts import Padded
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.frontend.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
GPT = ROOT / "examples" / "gpt"
LLAMA = ROOT / "examples" / "llama"
_counter = itertools.count()


def import_stage(path: Path, index: int) -> type:
    name = f"parallelizer_test_emitted_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, f"Stage{index}")


def compile_example(folder: Path, overrides, weights):
    return compile_model(folder / "model.py", load_spec(folder / "spec.yaml", overrides),
                         weights=weights)


def fresh_model(folder: Path):
    module = load_model_file(folder / "model.py")
    return module, module.build_model().eval()


# --- gpt, tp=1 pp=1, with weights ------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "out"
    compile_example(GPT, ["mesh.tp=1", "mesh.pp=1"], weights=True).save(out)
    return out


@pytest.fixture(scope="module")
def gpt_stage(gpt_out):
    stage = import_stage(gpt_out / "program" / "stage0.py", 0)()
    full = load_full(gpt_out / "checkpoint")
    stage.load_state_dict({name: full[name] for name in stage.state_dict()}, strict=True)
    return stage.eval()


def test_out_folder_layout(gpt_out):
    for rel in ["program/stage0.py", "run.py", "plan.json", "report.md", "spec.yaml", "model.py",
                "checkpoint/manifest.json", "checkpoint/pp0-tp0.safetensors",
                "reference.safetensors"]:
        assert (gpt_out / rel).is_file(), rel
    plan = ParallelPlan.from_json((gpt_out / "plan.json").read_text())
    assert plan.mesh == {"pp": 1, "dp": 1, "tp": 1} and len(plan.stages) == 1
    assert "--nproc-per-node 1" in (gpt_out / "run.py").read_text()


def test_emitted_stage_keeps_original_fqns(gpt_stage):
    _, model = fresh_model(GPT)
    assert list(dict(gpt_stage.named_parameters())) != []
    assert set(gpt_stage.state_dict()) == set(model.state_dict())
    assert set(dict(gpt_stage.named_parameters())) == set(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        assert gpt_stage.get_parameter(name).shape == p.shape
    assert [n for n, _ in gpt_stage.emitted_blocks()] == [f"blocks.{i}" for i in range(4)]


def test_emitted_stage_reproduces_the_model(gpt_stage):
    module, model = fresh_model(GPT)
    for batch in [module.example_inputs(), (torch.randint(0, 96, (3, 29)),)]:
        with torch.no_grad():
            ref = model(*batch)
            got = gpt_stage(*batch)
        assert isinstance(got, tuple) and len(got) == 1
        torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-6)


def test_emitted_stage_matches_the_saved_reference(gpt_out, gpt_stage):
    ref = load_file(str(gpt_out / "reference.safetensors"))
    with torch.no_grad():
        got = gpt_stage(ref["input.idx"])
    torch.testing.assert_close(got[0], ref["output.0"], rtol=0, atol=1e-6)


def test_checkpoint_holds_the_model_weights(gpt_out):
    _, model = fresh_model(GPT)
    full = load_full(gpt_out / "checkpoint")
    sd = model.state_dict()
    assert set(full) == set(sd)
    for name, t in sd.items():
        assert torch.equal(full[name], t), name


def test_identical_gpt_blocks_emitted_once(gpt_out):
    src = (gpt_out / "program" / "stage0.py").read_text()
    assert src.count("class Block(EmittedModule)") == 1
    assert src.count(", Block),") == 4
    assert "device(type=" not in src               # devices come from self.runtime_device


# --- gpt, pp=2, without weights: the stages chain --------------------------------------------

def test_gpt_pp2_stages_chain_and_reproduce_the_model(tmp_path):
    program = compile_example(GPT, ["mesh.tp=1", "mesh.pp=2"], weights=False)
    assert program.state is None and program.reference is None
    program.save(tmp_path / "out")
    _, model = fresh_model(GPT)
    sd = model.state_dict()
    stages = []
    for i in range(2):
        stage = import_stage(tmp_path / "out" / "program" / f"stage{i}.py", i)()
        stage.load_state_dict({n: sd[n] for n in stage.state_dict()}, strict=True)
        stages.append(stage.eval())
    plan = program.plan
    assert plan.stages[0].outputs == plan.stages[1].inputs
    assert plan.stages[0].blocks == ("blocks.0", "blocks.1")
    assert plan.stages[1].blocks == ("blocks.2", "blocks.3")
    names = [set(s.state_dict()) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(sd)
    x = torch.randint(0, 96, (3, 9))
    with torch.no_grad():
        got = stages[1](*stages[0](x))
        ref = model(x)
    torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-6)


# --- llama, tp=2 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_tp2():
    pytest.importorskip("transformers")
    return compile_example(LLAMA, ["mesh.tp=2", "mesh.pp=1"], weights=False)


def test_llama_tp2_source_has_megatron_f_and_g(llama_tp2):
    src = llama_tp2.sources["program/stage0.py"]
    assert "from parallelizer.runtime import tp" in src
    # one block class for the 4 layers; sequence parallel and vocab_parallel (the defaults):
    # f before q/k/v, gate/up and the LM head is an all-gather fused with them, g after
    # o_proj, down_proj and the embedding lookup a reduce-scatter, and each RMSNorm weight
    # the sequence shard reads passes an f (gradient summed over tp)
    assert src.count("sequence.gathered_linears(") == 3
    assert src.count("sequence.reduce_scatter_to_sequence_parallel_region(") == 3
    assert src.count("tp.copy_to_tp_region(") == 3  # 2 per layer (block class) + final norm
    assert "tp.reduce_from_tp_region(" not in src
    assert src.count("vocab.vocab_parallel_lookup(") == 1
    assert "vocab.gather_from_tp_region(" not in src  # the logits go to loss_fn sharded
    assert src.count("class LlamaDecoderLayer(EmittedModule)") == 1
    assert src.count(", LlamaDecoderLayer),") == 4
    # local shapes for tp=2: q 4 heads x 16 -> 2 heads; k/v 2 kv heads -> 1; MLP 128 -> 64
    for entry in ["('self_attn.q_proj.weight', (32, 64), 'float32')",
                  "('self_attn.k_proj.weight', (16, 64), 'float32')",
                  "('self_attn.o_proj.weight', (64, 32), 'float32')",
                  "('mlp.down_proj.weight', (64, 64), 'float32')"]:
        assert entry in src
    assert "TIED" in src and "('lm_head.weight', 'model.embed_tokens.weight')" in src
    assert "('model.embed_tokens.weight', (64, 64), 'float32')" in src  # 128 rows / 2


def test_llama_tp2_plan_placements(llama_tp2):
    tensors = llama_tp2.plan.tensors
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    o = tensors["model.layers.0.self_attn.o_proj.weight"]
    assert (q.tp_dim, q.role) == (0, "column_parallel") and q.local_shape(2) == (32, 64)
    assert (o.tp_dim, o.role) == (1, "row_parallel") and o.local_shape(2) == (64, 32)
    e = tensors["model.embed_tokens.weight"]
    assert (e.tp_dim, e.role) == (0, "vocab_parallel") and e.local_shape(2) == (64, 64)
    assert e.layout == Padded(128)  # reshard pads it for other tp
    assert llama_tp2.plan.vocab_outputs == ((0, 128),)
    assert llama_tp2.plan.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_llama_emitted_source_has_no_hardcoded_device(llama_tp2):
    src = llama_tp2.sources["program/stage0.py"]
    assert "device(type=" not in src


def test_llama_no_weights_program_runs_on_cpu(llama_tp2, tmp_path):
    path = tmp_path / "stage0.py"
    path.write_text(llama_tp2.sources["program/stage0.py"])
    stage = import_stage(path, 0)()             # tp group unset: f/g are identities
    torch.manual_seed(0)
    with torch.no_grad():
        for t in itertools.chain(stage.parameters(), stage.buffers()):
            t.normal_()
        # vocab_parallel: the lookup reads rank 0's 64 rows, the logits are its 64 columns
        out = stage(torch.randint(0, 64, (2, 5)))
    assert out[0].shape == (2, 5, 64)


# --- report.md in the user's language ---------------------------------------------------------

def test_report_names_replicated_linears_sends_and_attention_rewrites():
    """Every replicated linear named (the vocab_parallel head is not one), what a stage sends
    as module and per-rank shape (a sequence shard under sequence parallelism), and the SDPA
    calls the attention pass rewrote."""
    llama = compile_example(LLAMA, ["mesh.tp=2", "mesh.pp=2"], weights=False).report
    assert ("column_parallel: 20 linears; row_parallel: 8 linears; vocab_parallel LM head: "
            "lm_head.weight; replicated: none") in llama
    assert "| model.layers.1: (batch, seq/2, 64) float32 |" in llama
    assert "- causal mask -> is_causal, repeated kv heads -> enable_gqa: model.layers.{0..3}.self_attn" in llama
    minilm = ROOT / "examples" / "minilm"
    bert = compile_example(minilm, ["mesh.tp=2", "mesh.pp=1"], weights=False).report
    assert "; replicated: 1 linears (pooler.dense.weight)" in bert
    assert "## Attention" not in bert  # its padding mask is an input: nothing to prove


class _FrozenTable(torch.nn.Module):
    """A trained linear plus a table the model does not train (``requires_grad`` False, as
    RoFormer's sinusoidal position embedding)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.table = torch.nn.Parameter(torch.randn(5, 8), requires_grad=False)

    def forward(self, x):
        return self.fc(x) + self.table[: x.shape[1]]


def test_frozen_parameter_stays_frozen_in_the_program():
    """A parameter with ``requires_grad`` False is planned ``frozen`` and emitted in FROZEN:
    the program's copy gets no gradient and no update, as the model's (it got a gradient
    before, and --verify counted it as a mismatch against the reference's None)."""
    from parallelizer.compiler import compile_module
    from parallelizer.frontend.spec import Spec
    model, x = _FrozenTable(), torch.randn(2, 5, 8)
    program = compile_module(model, (x,), Spec.model_validate({}), reference=False)
    assert program.plan.tensors["table"].frozen and not program.plan.tensors["fc.weight"].frozen
    src = program.sources["program/stage0.py"]
    assert "FROZEN = ('table',)" in src
    path = Path(__file__).parent / f"_emitted_frozen_{next(_counter)}.py"
    try:
        path.write_text(src)
        stage = import_stage(path, 0)()
    finally:
        path.unlink()
    assert not stage.get_parameter("table").requires_grad
    assert stage.get_parameter("fc.weight").requires_grad
