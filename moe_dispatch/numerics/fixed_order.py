"""Sums and matrix products whose per-element order is fixed by the operand shapes we name.

A BLAS ``mm`` chooses its kernel, blocking and thread split from the whole problem (M, N, K,
strides, alignment, thread count, CPU model), so one row's bits can change with the number of
rows in the call, and which M's differ changes from CPU to CPU. `ordered_mm` calls no BLAS: it
multiplies with one elementwise op and sums over K with `tree_sum`, a fixed pairwise tree of
elementwise adds. Every elementwise mul, add and cast is one correctly rounded IEEE operation on
each element, whatever vectorisation or thread split torch picks, so ``out[i, j]`` is a function
of row i of ``a``, column j of ``b`` and K only.

Under torch.compile both entry points run eagerly (``torch.compiler.disable``): dynamo cannot
trace an ``out=`` into a strided view (it broke the graph in every tree level and then compiled
`_tree_level` once per level size, up to its recompile limit), and a compiler that fused the
elementwise ops could contract a product and a sum into one FMA, changing the bits.
"""

from __future__ import annotations

import torch

# Elements of the [rows, K, N] product block one step materialises: small enough to stay in
# cache; any value gives the same bits (each output element is computed wholly inside one block).
_BLOCK_ELEMENTS = 1 << 20


def _tree_level(x: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor:
    """One level of `tree_sum` from x (size s along dim) into the first ceil(s/2) slices of out."""
    s = x.shape[dim]
    h = s // 2
    torch.add(x.narrow(dim, 0, h), x.narrow(dim, s - h, h), out=out.narrow(dim, 0, h))
    if s % 2:
        torch.add(x.narrow(dim, h, 1), 0.0, out=out.narrow(dim, h, 1))
    return out.narrow(dim, 0, s - h)


def _tree_sum_inplace(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`tree_sum` of x (size >= 1 along dim) overwriting x; returns a view of it."""
    while x.shape[dim] > 1:
        x = _tree_level(x, dim, x)
    return x.squeeze(dim)


@torch.compiler.disable
def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` by a fixed pairwise tree of elementwise adds (``dim`` removed).

    A level of size s keeps ceil(s/2) = s - h slices: slice i < h becomes ``x[i] + x[i + s - h]``
    and, when s is odd, slice h becomes ``x[h] + 0`` (as if a zero were appended). The order thus
    depends on the size of ``dim`` only. torch's reduction kernels pick their split from the whole
    tensor's shape, so their per-element order can change with the other dims.
    """
    dim = dim % x.dim()
    s = x.shape[dim]
    if s <= 1:
        return x.squeeze(dim) if s else x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
    y = x.new_empty(x.shape[:dim] + (s - s // 2,) + x.shape[dim + 1 :])  # x itself is left alone
    return _tree_sum_inplace(_tree_level(x, dim, y), dim)


@torch.compiler.disable
def ordered_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` [M, K] @ ``b`` [K, N] -> [M, N] in their dtype, without a BLAS call.

    Each product ``a[i, k] * b[k, j]`` is rounded once in the accumulation dtype (float32 for
    16- and 32-bit floats, where a bf16/fp16 product is exact; float64 for float64) and the K
    products are summed by `tree_sum`, then rounded once to the operands' dtype. Row i of the
    result depends on row i of ``a`` only, never on M or on where the row sits, and column j on
    column j of ``b`` only (so a reduction over rows, ``x.T @ dy``, depends on those rows and
    their order only).
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.dtype != b.dtype:
        raise ValueError(f"ordered_mm needs a [M, K] and b [K, N] of one dtype, got {a.dtype} "
                         f"{list(a.shape)} and {b.dtype} {list(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if k == 0 or m == 0 or n == 0:
        return out.zero_()
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    a, b = a.to(acc), b.to(acc).contiguous()
    rows = min(m, max(1, _BLOCK_ELEMENTS // (k * n)))
    products = torch.empty(rows, k, n, dtype=acc, device=a.device)  # reused block by block
    for s in range(0, m, rows):
        p = products[: min(rows, m - s)]
        torch.mul(a[s : s + rows, :, None], b, out=p)
        out[s : s + rows] = _tree_sum_inplace(p, dim=1)
    return out
