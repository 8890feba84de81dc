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

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per operand kind and N, never M (the row
# stability above); a 256-wide N tile only where N fills it. Their timings beside alternatives:
# BENCHMARKS.md "Router". fp32 operands use input_precision="ieee": TF32 would lower the router
# precision below fp32.
def _config_for(kind: str, n: int) -> tuple:
    if kind == "half":
        return (128, 256, 64, 8, 3) if n >= 256 else (64, 128, 64, 4, 4)
    if kind == "split":  # half x (fp32 split in three): fp32 weight tiles need more shared memory
        return (64, 128, 64, 4, 3)
    if kind == "fp32":
        return (128, 128, 32, 8, 3)
    return (32, 32, 16, 4, 2)  # fp64


_HALF = (torch.bfloat16, torch.float16)

if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                  torch.float64: tl.float64}

    @triton.jit(do_not_specialize=["M"])
    def _row_stable_mm_kernel(
        a_ptr, b_ptr, c_ptr, M, N, K,
        stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        OP_TY: tl.constexpr, SPLIT_B: tl.constexpr,
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
            ).to(OP_TY)
            b = tl.load(
                b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0,
            )
            if SPLIT_B:
                # fp32 b == hi + mid + lo exactly (8 significant bits each), and a half x half
                # product is exact in fp32: three tensor-core dots give the fp32 products.
                hi = b.to(OP_TY)
                rest = b - hi.to(tl.float32)
                mid = rest.to(OP_TY)
                lo = (rest - mid.to(tl.float32)).to(OP_TY)
                acc = tl.dot(a, hi, acc, out_dtype=acc_ty)
                acc = tl.dot(a, mid, acc, out_dtype=acc_ty)
                acc = tl.dot(a, lo, acc, out_dtype=acc_ty)
            else:
                acc = tl.dot(a, b.to(OP_TY), acc, input_precision="ieee", out_dtype=acc_ty)
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


def triton_row_stable_mm(
    a: torch.Tensor, b_t: torch.Tensor, out_dtype: torch.dtype, _config: Optional[tuple] = None,
    store_dtype: Optional[torch.dtype] = None,
) -> Optional[torch.Tensor]:
    """``a @ b_t.T`` for a: [M, K], b_t: [N, K] on CUDA in ``out_dtype`` -> [M, N]; None if unsupported.
    ``store_dtype``: the result is stored in this dtype instead (each ``out_dtype`` value rounded once
    as it is written, bitwise ``.to(store_dtype)`` of the ``out_dtype`` result, without that tensor).

    With half activations and an fp32 (or half) result, the products are taken on half operands
    with fp32 accumulation on tensor cores: a bf16 x bf16 product is exact in fp32, and an fp32
    weight is split exactly into three bf16 parts, so every product is the exact fp32 product of
    the upcast values. Otherwise the operands are cast to ``out_dtype`` (an exact upcast, or the
    rounding that ``weight.to(router_dtype)`` does).
    """
    if triton is None or out_dtype not in _TL_DTYPES:
        return None
    split_b = False
    if out_dtype == torch.float64:
        # Triton cannot feed half operands converted in registers to an fp64 dot ("largeK MMA").
        op_dtype, kind = torch.float64, "fp64"
        a, b_t = a.to(torch.float64), b_t.to(torch.float64)
    elif a.dtype in _HALF and out_dtype in (a.dtype, torch.float32) and b_t.dtype in (a.dtype, torch.float32):
        op_dtype, kind = a.dtype, "half"
        split_b = b_t.dtype == torch.float32 and out_dtype == torch.float32
        kind = "split" if split_b else kind
    else:
        op_dtype, kind = out_dtype, ("fp32" if out_dtype == torch.float32 else "half")
    bm, bn, bk, warps, stages = _config or _config_for(kind, b_t.shape[0])  # _config: scripts/measure/gating_tiles.py
    m, k = a.shape
    n = b_t.shape[0]
    out = torch.empty(m, n, dtype=store_dtype or out_dtype, device=a.device)
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
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, OP_TY=_TL_DTYPES[op_dtype], SPLIT_B=split_b,
            num_warps=warps, num_stages=stages,
        )
    return out
