"""Row-stable gating GEMM: ``logits = hidden @ weight.T`` computed in the router dtype.

"Row-stable" means row t of the result is bitwise the same whatever other rows share the call.
Library GEMMs do not promise this: they pick kernels by M (CPU fp32 mm changes below M=8, CPU fp64
mm treats odd M differently, cuBLAS on H200 changes between M<=64 and M>=128). So:

* CUDA: one Triton kernel (_triton_gemm.py) whose tile configuration depends on the dtypes and
  E only, never on M, so every output element accumulates over K in the same order whatever M
  is. With bf16/fp16 activations it multiplies on tensor cores with fp32 accumulation (every
  product exact, as in Megatron's TE router GEMM; the accumulation is not IEEE-sequential, about
  5x the error of cuBLAS SGEMM against an fp64 reference, measured on H200). fp32 activations use
  an IEEE fp32 FMA kernel, fp64 an fp64 one. Without triton, CUDA falls back to the blocked path
  below (fixed-shape cuBLAS calls; not measured for row stability).
* CPU: the rows are cut into blocks of exactly ``CPU_ROW_BLOCK`` rows (the last one
  zero-padded) and each block is one ``torch.mm`` of that fixed shape, so the library sees the
  same problem every time. A row's result was measured to be independent of its position inside
  the block (tests/router/test_router_gating.py keeps checking it).

Backward (deterministic run to run; batch invariance is a forward promise): ``grad_weight =
grad_logits.T @ hidden`` is one library GEMM. ``grad_hidden = grad_logits @ weight`` is row-stable
on CPU (blocked, nearly free) and one cuBLAS GEMM on CUDA (an fp32 FMA kernel in Triton was
2-3x slower than cuBLAS there, and the gradient need not be row-stable).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..autograd import refuse_double_backward

CPU_ROW_BLOCK = 128


def _blocked_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` for a: [M, K], b_t: [N, K], one fixed-shape mm per 128-row block -> [M, N]."""
    m = a.shape[0]
    n = b_t.shape[0]
    blocks = -(-m // CPU_ROW_BLOCK)
    out = torch.empty(blocks * CPU_ROW_BLOCK, n, dtype=a.dtype, device=a.device)
    full = m // CPU_ROW_BLOCK
    b = b_t.t()
    for i in range(full):
        rows = slice(i * CPU_ROW_BLOCK, (i + 1) * CPU_ROW_BLOCK)
        torch.mm(a[rows], b, out=out[rows])
    if full < blocks:
        tail = torch.zeros(CPU_ROW_BLOCK, a.shape[1], dtype=a.dtype, device=a.device)
        tail[: m - full * CPU_ROW_BLOCK] = a[full * CPU_ROW_BLOCK :]
        torch.mm(tail, b, out=out[full * CPU_ROW_BLOCK :])
    return out[:m]


def row_stable_mm(a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row-stable ``(a @ b_t.T)`` computed in ``out_dtype``.

    Args:
        a: [M, K], any float dtype (upcast to ``out_dtype`` exactly).
        b_t: [N, K], the right operand transposed (as nn.Linear stores weights); cast to
            ``out_dtype`` like ``weight.to(router_dtype)``.
        out_dtype: compute and result dtype (bf16/fp16 accumulate in fp32).
    Returns:
        [M, N] in ``out_dtype``.
    """
    if a.is_cuda:
        from ._triton_gemm import triton_row_stable_mm

        result = triton_row_stable_mm(a, b_t, out_dtype)
        if result is not None:
            return result
    return _blocked_mm(a.to(out_dtype), b_t.to(out_dtype).contiguous())


class _GatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.dtype = dtype
        return row_stable_mm(hidden, weight, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        refuse_double_backward("_GatingLinear")
        hidden, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            if grad.is_cuda:
                grad_hidden = torch.mm(grad, weight.to(ctx.dtype)).to(hidden.dtype)
            else:  # [T, E] @ [E, H]: the right operand transposed is weight.T, [H, E]
                grad_hidden = row_stable_mm(grad, weight.t(), ctx.dtype).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            # A reduction over tokens: deterministic for a fixed T, batch-dependent by nature.
            grad_weight = torch.mm(grad.t(), hidden.to(ctx.dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None


def gating_linear(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Router logits ``hidden @ weight.T`` in ``dtype``, bitwise independent of the other rows.

    Args:
        hidden: [T, H] activations (any float dtype).
        weight: [E, H] gating weight (any float dtype).
        dtype: router dtype of the GEMM and of the result.
    Returns:
        logits [T, E] in ``dtype``; differentiable wrt ``hidden`` and ``weight``.
    """
    return _GatingLinear.apply(hidden, weight, dtype)
