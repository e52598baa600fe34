"""Dropout inside a ``@torch.jit.script`` function (Megatron's and GPT-NeoX's
``bias_dropout_add``): TorchScript calls no Python, so ``rng.EagerDropoutOff`` never saw it,
and from its third call the JIT's optimized plan runs a fused ``native_dropout`` with its own
autodiff, out of ``rng.RandomStandIns``' reach: the unmodified model drew a new mask on every
reference step, and every layout stopped with an internal error (zoo 17 Z4). The JIT runs
unoptimized under EagerDropoutOff."""
import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.compiler import compile_module
from parallelizer.frontend.spec import Spec
from parallelizer.runtime.rng import EagerDropoutOff, RandomStandIns


@torch.jit.script
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                     prob: float) -> torch.Tensor:
    return residual + F.dropout(x + bias, p=prob, training=True)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32, bias=False)
        self.bias = nn.Parameter(torch.zeros(32))

    def forward(self, x):
        return bias_dropout_add(self.down(torch.relu(self.up(x))), self.bias, x, 0.1)


def _batch():
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))


def test_the_reference_step_repeats_from_any_generator_state_past_the_jits_warmup():
    model, steps, x = _Block(), [], _batch()
    for seed in range(4):  # the optimized plan from the third call
        torch.manual_seed(seed)
        model.zero_grad()
        with EagerDropoutOff(), RandomStandIns():
            out = model(x)
        out.square().sum().backward()
        steps.append((out.detach(), model.bias.grad.clone()))
    for out, grad in steps[1:]:
        assert torch.equal(out, steps[0][0]) and torch.equal(grad, steps[0][1])
    with torch.no_grad():  # dropout inactive: the block without it, bit for bit
        assert torch.equal(steps[0][0], x + (model.down(torch.relu(model.up(x))) + model.bias))


def test_a_scripted_bias_dropout_add_compiles_at_tp2_with_the_self_check():
    program = compile_module(_Block(), (_batch(),), Spec.model_validate({"mesh": {"tp": 2}}),
                             reference=True)
    assert [n for n in program.notes if n.startswith("self-check: 2 tp rank")], program.notes
    assert "2 of 2 weight matrices" in program.report, program.report
