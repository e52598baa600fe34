"""What a unit runs, kernel by kernel (advisor/kernels.py, inventory.py, shape_kernels.py):
autograd's own ops recorded on FakeTensors, tensor-parallel roles from the compiler's
planners, any micro-batch size from the graph's symbolic batch, and a shape's kernels
agreeing with a captured model's.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from parallelizer.advisor.kernels import Kernel, record
from parallelizer.advisor.shape_kernels import ShapeKernels
from parallelizer.advisor.workload import from_shape, parse_shape


def test_a_linear_runs_one_matmul_forward_and_two_backward():
    with FakeTensorMode():
        x = torch.empty(2, 16, 64, requires_grad=True)
        w = torch.empty(128, 64, requires_grad=True)
        fwd, bwd = record(lambda a, b: torch.ops.aten.linear.default(a, b), [x, w], [w])
    mm = [k for k in fwd if k.kind == "mm"]
    assert [k.dims for k in mm] == [(1, 32, 128, 64)] and mm[0].flops == 2 * 32 * 128 * 64
    grads = [k for k in bwd if k.kind == "mm"]
    assert len(grads) == 2 and sum(k.weight_grad for k in grads) == 1   # dW marked, dX not
    assert all(k.kind == "view" for k in fwd if k.kind != "mm")          # t, view: metadata only


def test_tensor_parallel_roles_split_the_right_dimension():
    col = Kernel("mm", 2.0 * 32 * 128 * 64, 1.0, (1, 32, 128, 64))
    assert col.sharded("column", 128, 4, True).dims == (1, 32, 32.0, 64)
    row = Kernel("mm", 2.0 * 32 * 64 * 128, 1.0, (1, 32, 64, 128))
    assert row.sharded("row", 128, 4, True).dims == (1, 32, 64, 32.0)
    norm = Kernel("elem", 0.0, 1000.0)
    assert norm.sharded("seq", 0, 4, False).bytes == 1000.0    # replicated without sequence parallelism
    assert norm.sharded("seq", 0, 4, True).bytes == 250.0      # a sequence shard with it
    assert norm.sharded("replicated", 0, 4, True).bytes == 1000.0


def test_captured_llama_inventory(tools):
    from parallelizer.advisor.capture import capture_workload
    w = capture_workload(tools.examples / "llama" / "model.py", None)
    units = w.source.units(2)
    block = units[1]
    mm = [k for _, _, k in block.fwd if k.kind == "mm"]
    assert len(mm) == 7                                       # q, k, v, o, gate, up, down
    assert sum(k.weight_grad for _, _, k in block.bwd if k.kind == "mm") == 7
    assert sum(k.kind == "attn" for _, _, k in block.fwd) == 1  # SDPA: one fused call
    roles = {r for r, _, k in block.fwd if k.kind == "mm"}
    assert roles == {"column", "row"}
    assert [s for s, _ in block.sites] == ["f", "g", "f", "g"]  # Megatron's f/g: attention, MLP
    assert units[-1].fwd and any(k.kind == "elem" for _, _, k in units[-1].bwd)   # head + loss_fn
    # the batch dim is symbolic: micro-batch 4 doubles every activation-sized matmul
    mm4 = [k for _, _, k in w.source.units(4)[1].fwd if k.kind == "mm"]
    assert [a.flops * 2 for a in mm] == [b.flops for b in mm4]
    assert w.ends_tp_sharded                                  # vocab_parallel applies to it


def test_a_model_without_a_config_gets_the_heads_the_tp_planner_splits(tools):
    """examples/gpt has no config: its 4 heads come from the tp planner (every size it
    splits a multiple of 4), not hidden // 64 (1, which left plan only tp = 1), and the
    figures line says so; its vocabulary from its embedding table (was 0: no logits)."""
    from parallelizer.advisor.capture import capture_workload
    from parallelizer.advisor.explain import sources_line
    from parallelizer.advisor.cluster import load_cluster
    w = capture_workload(tools.examples / "gpt" / "model.py", None)
    assert w.heads == 4 and w.vocab == 96  # VOCAB_SIZE: its embedding table's rows
    assert {r for r, _, k in w.source.units(2)[1].fwd if k.kind == "mm"} == {"column", "row"}
    cluster = load_cluster(tools.repo / "specs" / "clusters" / "h200-node.yaml")
    assert sources_line(cluster, w).endswith(
        "heads: no config; the sizes the tp planner splits (heads, features) are multiples of "
        "4: tp in {1, 2, 4}")


def test_shape_kernels_count_the_flops_of_eq3():
    shape = parse_shape("layers=4,hidden=1024,heads=16,vocab=32000,seq=512")
    w = from_shape(shape, attention="eager")
    units = ShapeKernels(shape, "eager").units(1)
    block_fwd = sum(k.flops for _, _, k in units[1].fwd)
    assert block_fwd == pytest.approx(w.fwd_flops[1], rel=1e-9)       # 24 s h^2 (1 + s / 6h)
    assert sum(k.flops for _, _, k in units[1].bwd) == pytest.approx(2 * w.fwd_flops[1], rel=1e-9)
    flash = ShapeKernels(shape, "flash").units(1)[1]
    scores = 16 * 512 * 512 * 4                   # a x s x s, fp32 units
    saved = sum(k.bytes for _, _, k in units[1].fwd) - sum(k.bytes for _, _, k in flash.fwd)
    assert saved >= 4 * scores                    # softmax and dropout never read or write them
