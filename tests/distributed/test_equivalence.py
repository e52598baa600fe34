"""Numerical equivalence of the emitted program with the unmodified model, per example and mesh.

Each case compiles with the real CLI and runs ``torchrun OUT/run.py --verify`` on CPU (gloo,
fp32): one forward, backward and SGD step on the reference inputs, with the loss, the
outputs, the gradients gathered to full shape and the updated parameters compared with
``reference.safetensors``. Besides run.py's own PASS (verify.atol = rtol = 1e-5), each of the
four max abs errors must be within ``TOL``.
"""
import pytest

TOL = 1e-5  # fp32, absolute
# MiniLM's last_hidden_state reaches |5.8|, and the unmodified model in fp32 differs from
# itself in fp64 by 9.7e-6 there; summing the row-parallel halves in another order (tp=2)
# moves it by 1.5e-5 (about 30 ulp at 5.8). Relative to its scale that is 3e-6.
TOL_OVERRIDE = {("minilm", "outputs"): 5e-5}

EXAMPLES = ("gpt", "llama", "minilm")
MESHES = {  # id -> (dp, tp, pp)
    "tp2": (1, 2, 1),
    "pp2": (1, 1, 2),
    "dp2": (2, 1, 1),
    "tp2-pp2": (1, 2, 2),
    "dp2-tp2": (2, 2, 1),
}


def _mesh_args(mesh):
    dp, tp, pp = MESHES[mesh]
    return f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}"


# tp layouts beyond the even split: GPT-2's Conv1D with the fused q|k|v c_attn (with pp=2:
# the tied wte/lm_head spans both stages), and Llama's 2 kv heads copied over 4 tp ranks
# (run.py --verify also checks that the copies' gradients and weights agree). Compiled with
# test_train_equivalence's optimizer overrides, so one compile serves both tests.
MESHES["tp4"] = (1, 4, 1)
LAYOUT_CASES = [("gpt2", "tp2-pp2"), ("llama", "tp4")]
TRAIN_OPTIMIZER = ("optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.weight_decay=0.0")


def _overrides(example, mesh):
    extra = TRAIN_OPTIMIZER if (example, mesh) in LAYOUT_CASES else ()
    return (*_mesh_args(mesh), *extra)


CASES = [pytest.param(example, mesh, id=f"{example}-{mesh}",
                      marks=pytest.mark.precompile(example, *_overrides(example, mesh)))
         for example, mesh in [(e, m) for e in EXAMPLES for m in MESHES if m != "tp4"]
         + LAYOUT_CASES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example, mesh", CASES)
def test_verify_matches_reference(compiled, tools, example, mesh):
    dp, tp, pp = MESHES[mesh]
    out = compiled(example, *_overrides(example, mesh))
    res = tools.torchrun(out, dp * tp * pp, "--verify")
    errs = tools.verify_errors(res.stdout)
    print(f"\n{example} {mesh}: " + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()))
    assert res.stdout.rstrip().endswith("PASS"), res.explain()
    assert set(errs) == {"loss", "outputs", "gradients", "parameters"}, res.explain()
    for cat, err in errs.items():
        assert err <= TOL_OVERRIDE.get((example, cat), TOL), (cat, err)
    tools.check_exit(res)
