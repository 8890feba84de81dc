"""Which row counts M give one token's row other bits than M=1 on the plain CUDA GEMM paths:
cuBLAS mm (``"loop"``, fp32 and bf16) and grouped_mm (``"grouped"``, bf16 only). What the default
paths promise is asserted by tests/experts/test_gpu.py; this prints what the plain ones do on
this GPU and library build.

Run on a CUDA machine:  python scripts/measure/gpu_plain_paths.py
"""
from __future__ import annotations

import torch

from moe_dispatch.experts import expert_gemm

ROWS = [1, 2, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384]


def differing_rows(dtype: torch.dtype, strategy: str) -> dict:
    """max |row - row(M=1)| -> the M values giving it, for the token at row M // 2."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 4096, 1024, generator=g).to("cuda", dtype)
    token = torch.randn(4096, generator=g).to("cuda", dtype)
    ref, classes = None, {}
    for m in ROWS:
        x = torch.randn(m, 4096, generator=g).to("cuda", dtype)
        x[m // 2] = token
        row = expert_gemm(x, w, torch.tensor([m]), strategy)[m // 2]
        ref = row if ref is None else ref
        classes.setdefault(float((row.float() - ref.float()).abs().max()), []).append(m)
    return classes


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, K=4096, N=1024; max|row - row(M=1)| -> M values")
    for strategy, dtype in (("loop", torch.float32), ("loop", torch.bfloat16), ("grouped", torch.bfloat16)):
        print(f"{strategy:>8} {str(dtype):>15}: {differing_rows(dtype, strategy)}")
