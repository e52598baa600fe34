"""Mixed precision with a BatchNorm (passes/norm_precision.py): FSDP2 casts the weights it
gathers to ``param_dtype`` but never the running statistics (buffers), and
``aten.batch_norm`` refuses bf16 weights beside fp32 statistics. A break test's Conformer
(convolution module with a BatchNorm1d) crashed at its first step under
``mixed_precision.param_dtype: bf16`` at tp1 and tp2. Real FSDP2 on a one-rank gloo group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallelizer.passes.norm_precision import apply_norm_precision
from parallelizer.runtime.precision import in_stats_dtype
from tp_small_models import ConvBN, captured


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _x(seed=0):
    return torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(seed))


def _sharded(gm, mesh):
    fully_shard(gm, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return gm


def _run(module, x):
    out = module(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().sum().backward()
    return out


def test_a_batch_norm_runs_under_fsdp2_bf16_with_fp32_statistics(mesh):
    torch.manual_seed(0)
    model = ConvBN()
    gm = captured(model, (_x(),)).gm
    assert apply_norm_precision(gm, "bf16")
    casts = [n for n in gm.graph.nodes if n.target is in_stats_dtype]
    assert [c.args[0].target for c in casts] == ["bn.weight", "bn.bias"]
    assert all(c.args[1].target == "bn.running_mean" for c in casts)
    got = _run(_sharded(gm, mesh), _x(1))
    want = _run(model, _x(1))  # the unmodified model in fp32, the same batch statistics
    assert got.dtype == torch.bfloat16 and gm.bn.running_mean.dtype == torch.float32
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(gm.bn.running_mean, model.bn.running_mean, atol=1e-2, rtol=1e-2)
    for name, p in model.named_parameters():
        grad = dict(gm.named_parameters())[name].grad.full_tensor()
        torch.testing.assert_close(grad, p.grad, atol=5e-2, rtol=5e-2)


def test_without_the_pass_fsdp2_bf16_fails_in_the_batch_norm(mesh):
    """What the pass is for: the same graph unpatched fails inside the forward."""
    gm = captured(ConvBN(), (_x(),)).gm
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        _run(_sharded(gm, mesh), _x(1))


def test_fp32_programs_are_left_as_they_are():
    gm = captured(ConvBN(), (_x(),)).gm
    before = gm.code
    assert not apply_norm_precision(gm, "fp32") and gm.code == before
