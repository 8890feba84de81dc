"""Row-stable gating GEMM: ``logits = hidden @ weight.T`` computed in the router dtype.

"Row-stable" means row t of the result is bitwise the same whatever other rows share the call.
Library GEMMs do not promise this: they pick kernels by M, and which M's change a row depends on
the library and the CPU or GPU model (BENCHMARKS.md "Row stability of GEMMs"). So:

* CUDA: one Triton kernel (_triton_gemm.py) whose tile configuration depends on the dtypes and
  E only, never on M, so every output element accumulates over K in the same order whatever M
  is. With bf16/fp16 activations it multiplies on tensor cores with fp32 accumulation (every
  product exact, as in Megatron's TE router GEMM; the accumulation is not IEEE-sequential, so
  its error against an fp64 reference is larger than cuBLAS SGEMM's, BENCHMARKS.md "Row
  stability of GEMMs").
  fp32 activations use an IEEE fp32 FMA kernel, fp64 an fp64 one. Without triton, CUDA falls
  back to fixed-shape cuBLAS calls of ``FALLBACK_ROW_BLOCK`` rows (not measured for row stability).
* CPU: `moe_dispatch.numerics.fixed_order.ordered_mm`, elementwise products summed over H by a fixed
  pairwise tree, no BLAS call: a row's logits are a function of that row and the weight only,
  whatever kernels the CPU's library would pick.

Backward. The input gradient ``grad_logits [T, E] @ weight [E, H]`` is row-stable by the same
construction as the forward: `row_stable_mm` with ``weight.t()`` as the right operand (strides, no
copy): on CUDA the Triton kernel (tiles fixed by the dtypes and H, never by T), on CPU
`ordered_mm`; a token's input gradient depends on its own logits' gradient row and the weight
only. The weight gradient ``grad_logits.T @ hidden`` is a sum over the batch's tokens, so it
depends on the batch by nature: deterministic for a given batch (on CPU a fixed tree over the T
tokens by `ordered_mm`, on CUDA one cuBLAS GEMM).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..numerics.autograd import refuse_double_backward
from ..numerics.fixed_order import ordered_mm

FALLBACK_ROW_BLOCK = 128


def _blocked_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` for a: [M, K], b_t: [N, K], one fixed-shape mm per 128-row block -> [M, N]
    (CUDA without triton)."""
    m = a.shape[0]
    n = b_t.shape[0]
    blocks = -(-m // FALLBACK_ROW_BLOCK)
    out = torch.empty(blocks * FALLBACK_ROW_BLOCK, n, dtype=a.dtype, device=a.device)
    full = m // FALLBACK_ROW_BLOCK
    b = b_t.t()
    for i in range(full):
        rows = slice(i * FALLBACK_ROW_BLOCK, (i + 1) * FALLBACK_ROW_BLOCK)
        torch.mm(a[rows], b, out=out[rows])
    if full < blocks:
        tail = torch.zeros(FALLBACK_ROW_BLOCK, a.shape[1], dtype=a.dtype, device=a.device)
        tail[: m - full * FALLBACK_ROW_BLOCK] = a[full * FALLBACK_ROW_BLOCK :]
        torch.mm(tail, b, out=out[full * FALLBACK_ROW_BLOCK :])
    return out[:m]


def row_stable_mm(a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype,
                  store_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Row-stable ``(a @ b_t.T)`` computed in ``out_dtype``.

    Args:
        a: [M, K], any float dtype (upcast to ``out_dtype`` exactly).
        b_t: [N, K], the right operand transposed (as nn.Linear stores weights); cast to
            ``out_dtype`` like ``weight.to(router_dtype)``.
        out_dtype: compute and result dtype (bf16/fp16 accumulate in fp32).
        store_dtype: None, or the dtype the result is returned in: bitwise ``.to(store_dtype)`` of
            the ``out_dtype`` result (the Triton kernel rounds as it stores, with no ``out_dtype``
            tensor in between).
    Returns:
        [M, N] in ``store_dtype`` or ``out_dtype``.
    """
    store_dtype = store_dtype or out_dtype
    if a.is_cuda:
        from ._triton_gemm import triton_row_stable_mm

        # fp64 results are cast by torch: the kernel's fp64 -> half conversion is not known to be torch's
        in_kernel = store_dtype if out_dtype != torch.float64 else None
        result = triton_row_stable_mm(a, b_t, out_dtype, store_dtype=in_kernel)
        if result is not None:
            return result.to(store_dtype)
        return _blocked_mm(a.to(out_dtype), b_t.to(out_dtype).contiguous()).to(store_dtype)
    return ordered_mm(a.to(out_dtype), b_t.to(out_dtype).t()).to(store_dtype)


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
            # [T, E] @ [E, H]: weight.t() is the [N, K] = [H, E] right operand row_stable_mm takes.
            # Cast first (as the kernel would, [E, H] only): converting a bf16 weight in the
            # kernel's strided loads costs more than the cast (BENCHMARKS.md "Router").
            grad_hidden = row_stable_mm(grad, weight.to(ctx.dtype).t(), ctx.dtype, store_dtype=hidden.dtype)
        if ctx.needs_input_grad[1]:
            # A reduction over tokens: deterministic for a fixed T, batch-dependent by nature.
            mm = torch.mm if grad.is_cuda else ordered_mm
            grad_weight = mm(grad.t(), hidden.to(ctx.dtype)).to(weight.dtype)
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
