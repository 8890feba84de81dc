"""Fixed-configuration Triton GEMM for the CUDA gating path (see gating.py for why).

The tile configuration depends on the compute dtype only, never on M, and M is not specialised,
so every output element is accumulated over K in one fixed order whatever the number of rows.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional; gating.py falls back to fixed-shape blocked mm
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per operand dtype. fp32 operands use
# input_precision="ieee": TF32 would silently lower the router precision below fp32.
_CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4, 4),
    torch.float16: (64, 128, 64, 4, 4),
    torch.float32: (64, 64, 32, 4, 3),
    torch.float64: (32, 32, 16, 4, 2),
}
_HALF = (torch.bfloat16, torch.float16)

if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64}

    @triton.jit
    def _to_operand(x, OP_TY: tl.constexpr):
        if OP_TY == tl.float64:
            if x.dtype.is_bf16() or x.dtype.is_fp16():
                x = x.to(tl.float32)  # half -> fp64 has no direct lowering; via fp32 is exact
        return x.to(OP_TY)

    @triton.jit(do_not_specialize=["M"])
    def _row_stable_mm_kernel(
        a_ptr, b_ptr, c_ptr, M, N, K,
        stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        OP_TY: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc_ty = tl.float64 if OP_TY == tl.float64 else tl.float32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_ty)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            a = tl.load(
                a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0,
            )
            b = tl.load(
                b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0,
            )
            acc = tl.dot(_to_operand(a, OP_TY), _to_operand(b, OP_TY), acc, input_precision="ieee", out_dtype=acc_ty)
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def triton_row_stable_mm(
    a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype, _config: Optional[tuple] = None
) -> Optional[torch.Tensor]:
    """``a @ b_t.T`` for a: [M, K], b_t: [N, K] on CUDA in ``out_dtype`` -> [M, N]; None if unsupported.

    When both operands are the same half type and the result is at least as wide, the products
    are taken on the half operands: a bf16 x bf16 product is exact in fp32, so this is the same
    fp32 GEMM of the upcast values, accumulated in fp32 on tensor cores. Otherwise the operands
    are cast to ``out_dtype`` (an exact upcast, or the same rounding as ``w.to(router_dtype)``).
    """
    if triton is None or out_dtype not in _CONFIGS:
        return None
    half_operands = a.dtype == b_t.dtype and a.dtype in _HALF and out_dtype in (a.dtype, torch.float32)
    op_dtype = a.dtype if half_operands else out_dtype
    bm, bn, bk, warps, stages = _config or _CONFIGS[op_dtype]  # _config: for tuning scripts only
    m, k = a.shape
    n = b_t.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    # The interpreter (TRITON_INTERPRET=1) runs on CPU tensors; tests use it for indexing checks.
    ctx = torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext()
    with ctx:
        _row_stable_mm_kernel[grid](
            a, b_t, out, m, n, k,
            a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, OP_TY=_TL_DTYPES[op_dtype],
            num_warps=warps, num_stages=stages,
        )
    return out
