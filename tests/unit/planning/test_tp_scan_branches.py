"""A walk that meets its own branches at an add: minGRU (Feng et al. 2024, "Were RNNs All
We Needed?", its log-space Heinsen scan): ``hidden, gate = to_hidden_and_gate(x).chunk(2)``,
``a = cumsum(-softplus(gate))``, ``h = exp(a + logcumsumexp(log_values - a))``,
``to_out(h)``. Every op between the two linears works feature by feature (the scans run over
the sequence), so they are a Megatron pair. The seed walk, depth first, reached the add
``a + logcumsumexp(...)`` from ``a`` before the other branch and took it for the residual
stream: both linears replicated (a break test: 8 of 20 matrices). An operand computed from
the walk's own linear is no stream (planning/residual_stream.py ``residual_add``); each rank
equals the model (outputs, every gradient, one SGD step; fp32, 1e-5)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tp_check import plan_and_check
from tp_small_models import H, x_batch


def log_g(x):
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


def heinsen_associative_scan_log(log_coeffs, log_values):
    a_star = log_coeffs.cumsum(dim=1)
    log_h0_plus_b_star = (log_values - a_star).logcumsumexp(dim=1)
    return (a_star + log_h0_plus_b_star).exp()


class MinGRU(nn.Module):
    """As lucidrains/minGRU-pytorch writes it (its statement order decides the walk's)."""

    def __init__(self):
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(H, 4 * H, bias=False)
        self.to_out = nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)
        log_z = -F.softplus(-gate)
        log_tilde_h = log_g(hidden)
        return self.to_out(heinsen_associative_scan_log(log_coeffs, log_z + log_tilde_h))


class Net(nn.Module):
    """minGRU blocks with an MLP each, as minGRU-pytorch's LM: the MLP pairs whatever the
    scan does, so the planner's first candidate settles and is kept."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MinGRU() for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
                                  for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(4))

    def forward(self, x):
        for i, (layer, mlp) in enumerate(zip(self.layers, self.mlps)):
            x = x + layer(self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_min_gru_projections_are_a_megatron_pair(tp):
    torch.manual_seed(0)
    d = plan_and_check(Net(), x_batch(), tp)
    for i in range(2):
        assert f"layers.{i}.to_hidden_and_gate.weight" in d.column
        assert f"layers.{i}.to_out.weight" in d.row
        assert f"mlps.{i}.0.weight" in d.column and f"mlps.{i}.2.weight" in d.row
