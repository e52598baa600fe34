"""A grouped matmul over rows sorted by expert, and the offsets it reads, as torch ops.

A model whose experts are a list of modules (``nn.ModuleList`` of MLPs, a Python loop over
experts with ``torch.where`` per expert, as Mixtral's and DeepSeek's reference code) runs
each expert's ``F.linear`` on its own rows. The compiler's ``stack_experts`` pass
(passes/stack_experts.py) rewrites such a layer into the stacked form that expert
parallelism dispatches: the experts' rows concatenated (sorted by expert), their weights
stacked (E, out, in), and each linear replaced by ``parallelizer::grouped_mm`` over the
rows. Registered as custom ops (``torch.library``) so that FakeTensors (capture, estimate)
get shapes without running the data-dependent loop, as transformers' ``grouped_mm_fallback``
does.

``torch.ops.parallelizer.grouped_mm(input, weight, offs)``
    input (S, in) rows sorted by expert, weight (E, in, out) (the stacked (E, out, in)
    weights transposed), offs (E,) int32 cumulative rows per expert -> (S, out). Expert ``i``
    computes ``input[offs[i-1]:offs[i]] @ weight[i]``, the same ``mm`` as ``F.linear`` of
    that expert's rows (bit-equal on CPU), and its backward the same two ``mm``s.
``torch.ops.parallelizer.row_offsets(rows)``
    rows: E tensors (n_i, ...) -> (E,) int32 cumulative counts ``n_0, n_0 + n_1, ...``.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("parallelizer::grouped_mm", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = input.new_zeros(input.shape[0], weight.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(input[start:end], weight[i], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(input, weight, offs):
    torch._check(input.dim() == 2 and weight.dim() == 3 and offs.dim() == 1)
    torch._check(input.shape[1] == weight.shape[1] and offs.shape[0] == weight.shape[0])
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("parallelizer::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:  # F.linear's backward (mm_mat2_backward of W^T): dx = dy W, dW = (dy^T x)^T
            torch.mm(grad[start:end], weight[i].t(), out=grad_input[start:end])
            grad_weight[i] = torch.mm(grad[start:end].t(), input[start:end]).t()
        start = end
    return grad_input, grad_weight


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(input, weight, offs, grad):
    return torch.empty_like(input), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward(ctx, grad):
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.parallelizer.grouped_mm_backward(input, weight, ctx.offs, grad)
    return grad_input, grad_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("parallelizer::row_offsets", mutates_args=())
def row_offsets(rows: list[torch.Tensor]) -> torch.Tensor:
    counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    return torch.cumsum(counts, 0).to(torch.int32)


@row_offsets.register_fake
def _row_offsets_fake(rows):
    return torch.empty(len(rows), dtype=torch.int32, device=rows[0].device)
