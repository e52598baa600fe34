"""Dropout on model-parallel random streams (runtime/rng.py, planning/dropout.py,
passes/dropout.py): which stream each dropout draws from, the one-rank program drawing
exactly the eager model's masks, activation checkpointing recomputing the same masks, and
--verify's reference with dropout inactive. The tp=2 x pp=2 runs (replicated activations
bit-identical over tp, losses in the band of single-device runs, save/resume) are in
tests/distributed/test_dropout_training.py."""
from __future__ import annotations

import copy
import importlib.util
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_loads

from parallelizer.api import compile as pz_compile
from parallelizer.compiler import compile_model
from parallelizer.plan.parallel_plan import ParallelPlan
from parallelizer.emit.reference import compute_reference
from parallelizer.runtime import rng
from parallelizer.runtime.batching import flatten
from parallelizer.runtime.periodic import rng_state, set_rng_state
from parallelizer.runtime.train import reseed_dropout
from parallelizer.runtime.stage_builder import apply_activation_checkpointing, stage_class_from_source
from parallelizer.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt2_dropout"


def _example():
    spec = importlib.util.spec_from_file_location("_gpt2_dropout_example", EXAMPLE / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh_streams():
    """Each test seeds the streams it uses; none leaks seeded streams to later tests."""
    yield
    rng._seeds.clear()
    rng._generators.clear()


_BLOCKS = """
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.o = nn.Linear(8, 8)
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.probs_drop = nn.Dropout(0.1)
            self.hidden_drop = nn.Dropout(0.2)
            self.resid_drop = nn.Dropout(0.3)

        def heads(self, x):
            return x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)

        def forward(self, x):
            q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
            probs = self.probs_drop(torch.softmax(q @ k.transpose(-1, -2), dim=-1))
            a = (a + probs @ v).transpose(1, 2).reshape(x.shape)
            x = x + self.resid_drop(self.o(a))
            return x + self.down(self.hidden_drop(F.gelu(self.up(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_drop = nn.Dropout(0.5)
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            x = self.embed_drop(x)
            for layer in self.layers:
                x = layer(x)
            return x

    def build_model():
        return Net()

    def example_inputs():
        return (torch.randn(4, 3, 8),)
"""


def test_dropout_streams_follow_the_sharding_placements(tmp_path):
    """Megatron §3: sharded over tp -> each rank its own mask (attention probabilities of its
    heads, by SDPA or an explicit softmax; the activation between a column and a row linear);
    replicated over tp -> the same mask (embeddings, the residual branch after g). (At tp=1
    everything draws from the one replicated stream: the one-rank test below.)"""
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_BLOCKS))
    want = {"embed_drop": ("replicated", 0.5)}
    for i in (0, 1):
        want.update({f"layers.{i}": ("tp", 0.4), f"layers.{i}.probs_drop": ("tp", 0.1),
                     f"layers.{i}.hidden_drop": ("tp", 0.2),
                     f"layers.{i}.resid_drop": ("replicated", 0.3)})
    spec = load_spec(EXAMPLE / "spec.yaml", ["mesh.tp=2", "mesh.pp=1",
                                             "tensor_parallel.sequence_parallel=false"])
    program = compile_model(path, spec, weights=False)
    got = {d["module"]: (d["stream"], d["p"]) for d in program.plan.dropout}
    assert got == want, got
    source = program.sources["program/stage0.py"]
    assert "from parallelizer.runtime import rng" in source
    assert "rng.random_op('replicated', 'aten.dropout.default', x, 0.5, True)" in source
    assert "rng.random_op('tp', 'aten.scaled_dot_product_attention.default'" in source
    assert "tp stream, each tp rank its own mask (sharded over tp): 6 site(s)" in program.report
    # sequence parallel (auto): off for this example batch of 3 positions, said in the report
    spec = load_spec(EXAMPLE / "spec.yaml", ["mesh.tp=2", "mesh.pp=1"])
    program = compile_model(path, spec, weights=False)
    assert "sequence parallel: off (the example batch's sequence length (3) is not " \
           "divisible by mesh.tp (2)" in program.report
    # with 4 positions, the replicated-stream dropouts of the residual stream run on the
    # sequence shard, each rank applying its slice of the mask (Korthikanti et al. §4.2.2)
    path.write_text(textwrap.dedent(_BLOCKS).replace("randn(4, 3, 8)", "randn(4, 4, 8)"))
    program = compile_model(path, spec, weights=False)
    assert {d["module"]: (d["stream"], d["p"]) for d in program.plan.dropout} == want
    source = program.sources["program/stage0.py"]
    assert ("random_op_on_sequence_shard('replicated', 'aten.dropout.default', 1, None, "
            "split_to_sequence_parallel_region, 0.5, True)") in source  # embed_drop
    assert "random_op_on_sequence_shard('replicated', 'aten.dropout.default', 1, None, " \
           "add_tensor_1, 0.3, True)" in source  # resid_drop, in the (shared) block class
    assert "3 dropout(s) applying their slice of the full mask" in program.report
    assert "rng.random_op('tp', 'aten.scaled_dot_product_attention.default'" in source


def _stage(program):
    cls = stage_class_from_source(program.sources["program/stage0.py"], 0)
    stage = cls("cpu")
    with torch.no_grad():
        for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
            t.copy_(program.state[program.plan.aliases.get(name, name)])
    return stage


def _program_step(stage, plan, module, batch):
    flat = stage(*flatten(plan, batch))
    flat = flat if isinstance(flat, tuple) else (flat,)
    loss = module.loss_fn(tree_unflatten(list(flat), treespec_loads(plan.out_spec)), batch)
    loss.backward()
    return flat[0].detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}


def _eager_step(model, module, batch):
    out = model(**batch)
    module.loss_fn(out, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return tree_flatten(out)[0][0].detach(), grads


def test_one_rank_program_draws_the_eager_models_masks():
    """tp = pp = dp = 1, dropout active (GPT-2: embeddings, attention probabilities in SDPA,
    residual branches): two forward/backward passes of the emitted program equal the
    unmodified model's after ``torch.manual_seed(seed)``, outputs and every gradient (the
    graph keeps eager's op order, the replicated stream is seeded with ``seed``); also with
    activation checkpointing, whose recompute must draw the forward's masks again. The
    program never touches the default generator, and another seed gives other masks."""
    module, seed = _example(), 7
    model, batch = module.build_model(), module.example_inputs()
    spec = load_spec(EXAMPLE / "spec.yaml", ["mesh.tp=1", "mesh.pp=1", f"seed={seed}",
                                             "activation_checkpointing.mode=full"])
    program = pz_compile(copy.deepcopy(model), spec, batch, module.loss_fn, reference=False)
    plan = program.plan
    assert len(plan.dropout) == 13 and {d["stream"] for d in plan.dropout} == {"replicated"}
    for checkpointed in (False, True):
        eager, stage = copy.deepcopy(model), _stage(program)
        if checkpointed:
            apply_activation_checkpointing(stage, plan)
        torch.manual_seed(seed)
        want = [_eager_step(eager, module, batch) for _ in range(2)]
        rng.seed_streams(seed, 0, 0, 0, 1)
        torch.manual_seed(12345)  # the program must not draw from the default generator
        before = torch.get_rng_state()
        got = [_program_step(stage, plan, module, batch) for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), before)
        for (out, grads), (want_out, want_grads) in zip(got, want):
            torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
            assert grads.keys() == want_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], want_grads[name], atol=1e-6, rtol=1e-5,
                                           msg=f"{name} (checkpointed={checkpointed})")
    with rng.dropout_active(False):
        off = stage(*flatten(plan, batch))[0].detach()
    rng.seed_streams(seed + 1, 0, 0, 0, 1)
    other = stage(*flatten(plan, batch))[0].detach()
    for differs in (off, other):  # dropout is active, and its masks follow the seed
        assert (differs - want[0][0]).abs().max() > 0.1


def test_reference_and_verify_run_without_dropout():
    """--verify stays exact: the reference (compiled in) is the model with dropout
    inactive, equal to the model with every probability set to 0; the program's dropout
    under ``dropout_active(False)`` equals the op with p = 0 and draws nothing."""
    module = _example()
    spec = load_spec(EXAMPLE / "spec.yaml", ["mesh.tp=1", "mesh.pp=1"])
    model, batch = module.build_model(), module.example_inputs()
    names = ["input_ids"]
    got = compute_reference(copy.deepcopy(model), batch, module.loss_fn, names, spec)
    model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    want = compute_reference(model, batch, module.loss_fn, names, spec)
    assert got.keys() == want.keys() and any(k.startswith("grad.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    rng.seed_streams(0, 0, 0, 0, 1)
    x = torch.randn(4, 8)
    with rng.dropout_active(False):
        assert torch.equal(rng.random_op("replicated", "aten.dropout.default", x, 0.5, True), x)
        q = torch.randn(1, 2, 3, 4)
        got = rng.random_op("tp", "aten.scaled_dot_product_attention.default", q, q, q, None, 0.5)
        assert torch.equal(got, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert rng.state_dict() == {}  # nothing was drawn


class _Recurrent(torch.nn.Module):
    """A two-layer RNN with dropout between its layers (drawn inside ``aten.lstm``/``gru``)."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(8, 8, num_layers=2, dropout=0.5, batch_first=True)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_an_rnns_dropout_draws_the_eager_masks_and_is_off_under_verify(cls):
    """An RNN's dropout is a dropout site: the one-rank program draws the eager model's
    masks after ``torch.manual_seed(seed)``; under --verify the program
    (``dropout_active(False)``) and the reference (``EagerDropoutOff``) both run it with
    dropout 0, the model in eval mode (at dp2 the program drew it and the reference did not:
    --verify FAILed a correct program)."""
    torch.manual_seed(0)
    model, batch = _Recurrent(cls), {"x": torch.randn(4, 5, 8)}
    loss_fn = lambda out, b: out.square().mean()  # noqa: E731
    module = types.SimpleNamespace(loss_fn=loss_fn)
    spec = load_spec(EXAMPLE / "spec.yaml", ["mesh.tp=1", "mesh.pp=1", "seed=3"])
    program = pz_compile(copy.deepcopy(model), spec, batch, loss_fn, reference=False)
    assert [d["op"] for d in program.plan.dropout] == [f"aten.{cls.__name__.lower()}.input"]
    stage = _stage(program)
    torch.manual_seed(3)
    want_out, want_grads = _eager_step(copy.deepcopy(model), module, batch)
    rng.seed_streams(3, 0, 0, 0, 1)
    out, grads = _program_step(stage, program.plan, module, batch)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    off = copy.deepcopy(model).eval()(batch["x"]).detach()
    with rng.EagerDropoutOff():
        assert torch.equal(model(batch["x"]).detach(), off)
    with rng.dropout_active(False):
        torch.testing.assert_close(stage(*flatten(program.plan, batch))[0].detach(), off,
                                   atol=1e-6, rtol=1e-5)
    assert (out - off).abs().max() > 0.01  # the masks were drawn


def test_stream_seeds_and_saved_states():
    """Replicated: one seed per (pp, dp) coordinate, shared by its tp ranks, ``seed`` itself
    at (0, 0); tp: one per rank. A saved state restores the draws that follow it."""
    ranks = [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    seeds = {r: rng.stream_seeds(5, *r, tp=2) for r in ranks}
    assert seeds[(0, 0, 0)]["replicated"] == 5
    rep = {(p, d): {seeds[(p, d, t)]["replicated"] for t in range(2)} for p, d, _ in ranks}
    assert all(len(v) == 1 for v in rep.values()) and len({v.pop() for v in rep.values()}) == 4
    tp = {seeds[r]["tp"] for r in ranks}
    assert len(tp) == 8 and not tp & {s["replicated"] for s in seeds.values()}
    assert rng.stream_seeds(5, 0, 0, 0, tp=1) == {"replicated": 5}
    assert rng.stream_seeds(5, 0, 0, 0, tp=1, restart=3) != {"replicated": 5}

    rng.seed_streams(5, 1, 0, 1, 2)
    x = torch.ones(1000)
    for stream in ("replicated", "tp"):
        rng.random_op(stream, "aten.dropout.default", x, 0.5, True)
    saved = rng.state_dict()
    assert sorted(saved) == ["replicated.cpu", "tp.cpu"]
    want = [rng.random_op(s, "aten.dropout.default", x, 0.5, True) for s in ("tp", "replicated")]
    rng.seed_streams(5, 1, 0, 1, 2)
    rng.load_state_dict(saved)
    got = [rng.random_op(s, "aten.dropout.default", x, 0.5, True) for s in ("tp", "replicated")]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[0], want[1])


def test_resume_restores_the_streams_on_the_same_mesh_only(capsys):
    """``--resume``: the saved states of this rank's coordinate continue its draws exactly;
    a checkpoint saved on another mesh (resharded) has none for it: the streams are
    reseeded from the seed and the step (not the masks of steps 1..k again), and rank 0
    says so."""
    plan = _example_plan()
    ctx = types.SimpleNamespace(pp_rank=1, dp_rank=0, tp_rank=1, rank=0, device=torch.device("cpu"))
    x = torch.ones(256)
    draw = lambda: [rng.random_op(s, "aten.dropout.default", x, 0.5, True) for s in ("replicated", "tp")]
    rng.seed_streams(plan.seed, 1, 0, 1, 2)
    draw()
    saved = rng_state(ctx.device, plan.mesh)
    want = draw()
    rng.seed_streams(plan.seed, 1, 0, 1, 2)
    assert set_rng_state(saved, ctx.device, plan.mesh)
    assert all(torch.equal(a, b) for a, b in zip(draw(), want))

    rng.seed_streams(plan.seed, 1, 0, 1, 2)
    assert not set_rng_state(saved, ctx.device, {**plan.mesh, "tp": 1})  # another mesh: nothing
    reseed_dropout(plan, ctx, 3)
    assert rng._seeds == rng.stream_seeds(plan.seed, 1, 0, 1, 2, restart=3)
    out = capsys.readouterr().out
    assert out == ("note: the checkpoint holds no dropout RNG state for this mesh (pp=2 x dp=1 "
                   "x tp=2): dropout streams reseeded from seed 0 and step 3\n"), out


def _example_plan() -> ParallelPlan:
    site = {"node": "dropout", "module": "drop", "op": "aten.dropout.default", "p": 0.1,
            "stream": "replicated"}
    return ParallelPlan(mesh={"pp": 2, "dp": 1, "tp": 2}, zero_stage=0, schedule="1f1b",
                        microbatches=4, seed=0, tensors={}, aliases={}, stages=(), dropout=(site,))
