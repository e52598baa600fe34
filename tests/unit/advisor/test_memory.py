"""The memory model without processes: the ZeRO paper's figures (``estimate --params``),
the CLI's errors, FSDP2's chunking, activations against a real forward, and the spec errors
of the FSDP2-only options."""
import dataclasses

import pytest
import torch

from parallelizer.cli import parallelize as cli
from parallelizer.compiler import compile_module
from parallelizer.errors import SpecError
from parallelizer.frontend.model_file import load_model
from parallelizer.advisor.memory import estimate_program, fsdp_rows, zero_figures
from parallelizer.frontend.spec import load_spec


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_params_prints_the_zero_paper_figures(capsys):
    code, out, _ = run_cli(capsys, "estimate", "--params", "13e9", "--dp", "8")
    assert code == 0
    lines = out.splitlines()
    assert "Psi = 1.3e+10" in lines[0] and "N = 8" in lines[0] and "K = 12" in lines[0]
    expect = {0: ("16*Psi ", "208.00 GB"), 1: ("4*Psi + 12*Psi/N", "71.50 GB"),
              2: ("2*Psi + 14*Psi/N", "48.75 GB"), 3: ("16*Psi/N", "26.00 GB")}
    for stage, (formula, figure) in expect.items():
        line = next(l for l in lines if f"zero_stage {stage}" in l)
        assert formula in line and figure in line, line


def test_params_one_stage_prints_it_beside_ddp(capsys):
    code, out, _ = run_cli(capsys, "estimate", "--params", "13e9", "--dp", "8", "--zero-stage", "2")
    assert code == 0
    assert "zero_stage 0" in out and "zero_stage 2" in out and "48.75 GB" in out
    assert "zero_stage 1" not in out and "zero_stage 3" not in out


def test_zero_figures_are_the_paper_formulas():
    psi, n = 7.5e9, 64  # Figure 1 of Rajbhandari et al. 2020: 120, 31.4, 16.6, 1.9 GB
    got = [round(r["bytes"] / 1e9, 1) for r in zero_figures(psi, n)]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("argv, needle", [
    (("estimate",), "needs MODEL SPEC"),
    (("estimate", "--params", "13e9"), "--dp N"),
    (("estimate", "--params", "0", "--dp", "8"), "--params needs a count > 0"),
    (("estimate", "m.py", "s.yaml", "--params", "1e9", "--dp", "2"), "drop MODEL SPEC"),
    (("estimate", "m.py", "s.yaml", "--dp", "2"), "mesh.dp=N zero_stage=S"),
    (("estimate", "missing_model.py", "s.yaml"), "missing_model.py does not exist"),
])
def test_estimate_user_errors(capsys, argv, needle):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize("n, shards", [(7, 2), (5, 4), (3, 4), (128, 3), (0, 2)])
def test_fsdp_rows_follow_torch_chunk(n, shards):
    chunks = torch.arange(n).chunk(shards) if n else ()
    want = [len(c) for c in chunks] + [0] * (shards - len(chunks))
    assert [fsdp_rows(n, shards, i) for i in range(shards)] == want


@pytest.mark.parametrize("text, needle", [
    ("mesh: {dp: 4, dp_replicate: 3}\n", "mesh.dp_replicate (3) must divide mesh.dp (4)"),
    # param_dtype works under DDP too (autocast, fp32 master weights); a reduce dtype does not
    ("zero_stage: 1\nmixed_precision: {param_dtype: bf16, reduce_dtype: bf16}\n",
     "mixed_precision.reduce_dtype=bf16 needs FSDP2"),
    ("zero_stage: 0\nfsdp: {offload: true}\n", "fsdp.offload=true needs FSDP2"),
    ("zero_stage: 1\nfsdp: {prefetch: {forward: 2}}\n", "fsdp.prefetch.forward=2 needs FSDP2"),
    ("zero_stage: 0\nmesh: {dp: 4, dp_replicate: 2}\n", "mesh.dp_replicate=2 needs FSDP2"),
    ("mixed_precision: {param_dtype: fp8}\n", "mixed_precision.param_dtype must be one of 'fp32', 'bf16', 'fp16'"),
])
def test_fsdp_only_options_are_spec_errors(tmp_path, text, needle):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert needle in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def llama_pp2(tools):
    """The llama example compiled from its meta-device model for pp=2, 4 microbatches."""
    llama = load_model(tools.examples / "llama" / "model.py", on_meta=True)
    spec = load_spec(tools.examples / "llama" / "spec.yaml",
                     ["mesh.tp=1", "mesh.pp=2", "mesh.dp=1", "pipeline.microbatches=4"])
    program = compile_module(llama.model, llama.batch, spec, llama.loss_fn, reference=False)
    return llama, program


def _estimate(llama_pp2, **changes):
    llama, program = llama_pp2
    ac = changes.pop("activation_checkpointing", None)
    plan = dataclasses.replace(program.plan, **changes)
    plan = plan.with_activation_checkpointing(ac, plan.checkpoint_every) if ac else plan
    return plan, estimate_program(plan, program.sources, llama.batch, llama.loss_fn, "adamw")


def test_activations_follow_checkpointing_and_schedule(llama_pp2):
    _, none = _estimate(llama_pp2)
    _, full = _estimate(llama_pp2, activation_checkpointing="full")
    _, gpipe = _estimate(llama_pp2, schedule="gpipe")
    # 1F1B: stage 0 holds pp = 2 microbatches, the last stage 1; GPipe all 4
    assert [r.microbatches_in_flight for r in none] == [2, 1]
    assert [r.microbatches_in_flight for r in gpipe] == [4, 4]
    for n, f in zip(none, full):
        assert f.activations_per_microbatch < n.activations_per_microbatch / 2, (n, f)
        assert f.activations > f.activations_per_microbatch * f.microbatches_in_flight  # recompute
        assert f.parameters == n.parameters and f.optimizer == n.optimizer
    # optimizer: AdamW's two fp32 states per parameter (+ a 4-byte step per tensor)
    assert 2 * none[0].parameters <= none[0].optimizer <= 2 * none[0].parameters + 4 * 64


def test_activation_bytes_match_a_real_forward(llama_pp2):
    """The FakeTensor count of saved tensors equals the count on real tensors of the same
    emitted stage (stage 0 of the pp=2 program, one microbatch): same hook, real storages."""
    from parallelizer.advisor.activations import _Recorder
    from parallelizer.advisor.memory import load_stage
    llama, program = llama_pp2
    _, (est, _) = _estimate(llama_pp2)
    stage = load_stage(program.sources["program/stage0.py"], 0)  # real, uninitialised tensors
    from parallelizer.runtime.batching import flatten
    flat = flatten(program.plan, llama.batch)
    rec = _Recorder(stage, 1.0)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        stage(*[t[:t.shape[0] // 4] for t in flat])  # one of 4 microbatches
    real = sum(rec.bytes(block, int) for block in rec.saved)
    print(f"\nactivations of stage 0: estimated {est.activations_per_microbatch} bytes, "
          f"real forward {real}")
    assert real > 0 and abs(est.activations_per_microbatch - real) <= 0.05 * real


def _plan_of(schedule, pp, v, m):
    from parallelizer.plan.schedules import stage_ranks
    from parallelizer.plan.parallel_plan import ParallelPlan, StagePlan
    stages = tuple(StagePlan(s, f"stage{s}", (), (), (), (), r)
                   for s, r in enumerate(stage_ranks(schedule, pp, v)))
    return ParallelPlan(mesh={"pp": pp, "dp": 1, "tp": 1}, zero_stage=0, schedule=schedule,
                        microbatches=m, seed=0, tensors={}, aliases={}, stages=stages,
                        virtual_stages=v)


@pytest.mark.parametrize("schedule, pp, v, m, want", [
    # GPipe holds every microbatch; 1F1B min(pp - stage, m) (Narayanan et al. 2021, §2.2)
    ("gpipe", 2, 1, 4, [(4, 4), (40, 4)]),
    ("1f1b", 2, 1, 4, [(2, 2), (10, 1)]),
    ("1f1b", 4, 1, 8, [(4, 4), (30, 3), (200, 2), (1000, 1)]),
    # interleaved: Megatron-LM's warmup of 2 (pp - r - 1) + (v - 1) pp forwards, taken chunk
    # by chunk pp microbatches at a time, then one steady-state forward: rank 0 holds
    # microbatches 0-2 of stage 0 and 0-1 of stage 2, rank 1 0-1 of stage 1 and 0 of stage 3
    ("interleaved_1f1b", 2, 2, 4, [(3 + 200, 5), (20 + 1000, 3)]),
    # ZB-V (Qi et al. 2024, §6): rank 0 (stages 0 and 3) runs 3 forwards of stage 0, then
    # 3's; rank 1 (stages 1 and 2) alternates them; 2 pp stage-microbatches at the peak,
    # the same memory as 1F1B. Activations are freed by W (it still needs the saved inputs)
    ("zbv", 2, 2, 4, [(3 + 1000, 4), (20 + 200, 4)]),
])
def test_activations_held_follow_the_schedules_own_order(schedule, pp, v, m, want):
    """Stage s saves 10**s bytes per microbatch, so the peak spells out how many
    microbatches of each local stage a rank holds."""
    from parallelizer.advisor.memory import held_activations
    plan = _plan_of(schedule, pp, v, m)
    assert held_activations(plan, {s: 10 ** s for s in range(pp * v)}) == want


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_estimate_divides_the_vocabulary_by_tp(tools, vocab_parallel):
    """Per-rank parameter bytes at tp=2, pp=2 (zero_stage 0) from the formula: block matrices
    / tp, norms whole; the tied embedding / LM head (128 x 64) / tp under vocab_parallel (both
    stages hold a copy), whole otherwise."""
    llama = load_model(tools.examples / "llama" / "model.py", on_meta=True)
    spec = load_spec(tools.examples / "llama" / "spec.yaml",
                     ["mesh.tp=2", "mesh.pp=2", "mesh.dp=1", "zero_stage=0",
                      f"tensor_parallel.vocab_parallel={str(vocab_parallel).lower()}"])
    program = compile_module(llama.model, llama.batch, spec, llama.loss_fn, reference=False)
    ranks = estimate_program(program.plan, program.sources, llama.batch, llama.loss_fn,
                             "adamw")
    h, i, kv, vocab, tp = 64, 128, 32, 128, 2
    block = (2 * h * h + 2 * kv * h + 3 * h * i) // tp + 2 * h
    table = vocab * h // (tp if vocab_parallel else 1)
    want = [(2 * block + table) * 4, (2 * block + table + h) * 4]  # + the final norm
    assert [r.parameters for r in ranks[::tp]] == want
    assert all(r.parameters == want[r.pp] for r in ranks)


def _moe_estimate(*overrides):
    from pathlib import Path
    from parallelizer.advisor.memory import estimate_model_file
    models = Path(__file__).resolve().parents[2] / "distributed" / "user_models"
    return estimate_model_file(models / "mixtral_train.py",
                               load_spec(models / "spec.yaml", ["optimizer.name=adamw", *overrides]))


def test_estimate_counts_experts_per_ep_rank():
    """Mixtral (2 layers of 4 experts: gate_up (4, 128, 32), down (4, 32, 64) each, fp32) on
    the meta device (its integer histc) at dp2: at ep2 every rank holds half of each layer's
    experts, at ZeRO-0 and at ZeRO-3 (the experts sit outside FSDP2: neither sharded nor
    gathered), AdamW's two states likewise; the all-to-all buffers are 3 x the dispatched rows
    (4 rows x 8 tokens x top-2) x hidden 32 x 4 bytes. run.py --profile's MEMORY lines agree
    (tests/distributed/test_expert_parallel_verify.py)."""
    experts = 2 * (4 * 128 * 32 + 4 * 32 * 64) * 4  # bytes of all experts
    plan, ep1 = _moe_estimate("mesh.dp=2", "zero_stage=0")
    assert plan.ep == 1 and ep1[0].alltoall_buffers == 0
    _, ep2 = _moe_estimate("mesh.dp=2", "mesh.ep=2", "zero_stage=0")
    for a, b in zip(ep1, ep2):
        assert a.parameters - b.parameters == experts // 2 == a.gradients - b.gradients
        assert a.optimizer - b.optimizer == 2 * experts // 2
        assert b.alltoall_buffers == 3 * (4 * 8 * 2) * 32 * 4
    _, z3 = _moe_estimate("mesh.dp=2", "mesh.ep=2", "zero_stage=3")
    dense = ep1[0].parameters - experts  # FSDP2-sharded over the 2 dp ranks
    assert [r.parameters for r in z3] == [dense // 2 + experts // 2] * 2
    assert all(r.gathered_parameters <= dense for r in z3)  # experts never all-gathered


@pytest.mark.parametrize("name, rows", [("mistral_moe_reference", 4 * 8 * 2),  # torch.where, top-2
                                        ("switch_conv", 4 * 8 * 1)])            # x[mask], top-1
def test_estimate_values_per_module_expert_rows_at_balanced_routing(name, rows):
    """Per-module experts count their rows at run time (``torch.where`` of the routing mask, or
    a boolean index ``x[mask]``, which reaches the estimate's fake forward as ``aten.index``
    without a ``nonzero``): the all-to-all buffers are 3 x the dispatched rows (4 x 8 tokens per
    rank x top-k) x hidden 32 x 4 bytes, and the experts' activations are counted."""
    from pathlib import Path
    from parallelizer.advisor.memory import estimate_model_file
    models = Path(__file__).resolve().parents[2] / "distributed" / "user_models"
    spec = load_spec(models / "spec.yaml", ["mesh.dp=2", "mesh.ep=2"])
    _, ranks = estimate_model_file(models / f"{name}.py", spec)
    assert {r.alltoall_buffers for r in ranks} == {3 * rows * 32 * 4}


_PER_HEAD_BUFFER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

H, D, T = 4, 32, 8


class Retention(nn.Module):
    """RetNet-style: a per-head decay mask buffer (H, T, T) on head-sharded scores."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        gammas = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))
        n = torch.arange(T)
        decay = gammas[:, None, None] ** (n[:, None] - n[None, :]).clamp(min=0)
        self.register_buffer("decay", decay * (n[:, None] >= n[None, :]))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, H, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = (q @ k.transpose(-1, -2)) * self.decay[:, :t, :t]
        return x + self.o((s @ v).transpose(1, 2).reshape(b, t, D))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.layers = nn.ModuleList([Retention() for _ in range(2)])
        self.head = nn.Linear(D, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Model()


def example_inputs():
    return (torch.randint(0, 64, (2, T)),)


def loss_fn(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch[0].flatten())
'''


def test_estimate_runs_a_per_head_buffer_cut_to_the_ranks_heads(tmp_path):
    """``parallelize estimate`` ran the stages with f and g as identities, which left a
    replicated per-head buffer whole where the program cuts it to the rank's heads:
    RetNet-style models crashed at tp2 ("Attempting to broadcast a dimension of length 4")
    while their program ran and passed --verify (a break test). The tp operators now give a
    tp rank's shapes, as the compile's own shape check does."""
    from parallelizer.advisor.memory import estimate_model_file
    path, spec = tmp_path / "retention.py", tmp_path / "spec.yaml"
    path.write_text(_PER_HEAD_BUFFER)
    spec.write_text("mesh: {tp: 2}\n")
    plan, ranks = estimate_model_file(path, load_spec(spec))
    assert plan.mesh["tp"] == 2 and len(ranks) == 2
    assert all(r.activations > 0 for r in ranks)


_CONSTANT_VOCAB = '''
import torch
import torch.nn.functional as F
from torch import nn

V, D = 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return LM()


def example_inputs():
    return (torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(1)),)


def loss_fn(logits, batch):
    return F.cross_entropy(logits.reshape(-1, {width}), batch[0].reshape(-1))
'''


def test_estimate_runs_a_loss_fn_naming_the_vocabulary_size(tmp_path):
    """``logits.reshape(-1, V)`` with V a constant failed on one tp rank's vocabulary columns
    (vocab_parallel: the estimate runs loss_fn on plain tensors), though the program runs it
    (3 of 3 estimates in zoo 21). It now runs on the columns widened to the vocabulary, what
    it saves counted at 1 / tp: the same estimate as ``logits.size(-1)``."""
    from parallelizer.advisor.memory import estimate_model_file
    spec = tmp_path / "spec.yaml"
    spec.write_text("mesh: {tp: 2}\n")
    acts = {}
    for width in ("V", "logits.size(-1)"):
        path = tmp_path / f"lm_{len(acts)}.py"
        path.write_text(_CONSTANT_VOCAB.replace("{width}", width))
        plan, ranks = estimate_model_file(path, load_spec(spec))
        assert plan.vocab_outputs, "the head is vocab_parallel"
        acts[width] = [r.activations for r in ranks]
    assert acts["V"] == acts["logits.size(-1)"] and all(a > 0 for a in acts["V"]), acts
