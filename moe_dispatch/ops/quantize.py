"""Row-wise float8 quantisation: one fp32 scale per token, so a token's bytes depend on the token alone.

A per-tensor scale (a max over the whole batch) makes every token's quantised value depend on the
other tokens of the batch; a per-row scale does not, so FP8 tokens stay batch invariant.

The arithmetic, per row t of x (stated by torch_twin.quantize_rows; the Triton kernel computes the
same fp32 operations, so the two are bitwise equal; M is the format's largest value, 448 for
float8_e4m3fn, 57344 for float8_e5m2):

- amax = max |x[t, h]| (exact in any order);
- scale = amax / M and inv = M / amax, two correctly rounded fp32 divisions;
- q[t, h] = x[t, h] * inv (one fp32 multiply), saturated to [-M, M], rounded to nearest even;
- zero rows, and rows with amax < 2^-64 (where M / amax could overflow): scale = 1, and q is
  x rounded as it is (zeros: float8's smallest step is 2^-9, 2^-16 for e5m2);
- a row holding inf or NaN: scale NaN and q zeros, so the dequantised row q * scale is NaN.

q * scale approximates x to the format's precision (q[t] reaches +-M at the row's amax). Block
scales (MXFP8: one power-of-two scale per 32 elements) need Blackwell's scaled GEMMs; they are
not implemented (docs/ops.md says where the code is ready for them).

dequantize_rows widens float8 rows back by their scales (one fp32 multiply, one rounding to the
output dtype): the FP8 experts' saved rows for a weight gradient in the gradient's dtype.

quantize_group_columns applies the same arithmetic per (expert, column) over each expert's block
of rows, writing the quantised blocks transposed and padded per expert (the FP8 expert GEMM's
weight-gradient operands) in one kernel.
"""
from __future__ import annotations

from typing import Optional

import torch

from .custom_ops import _direct, _impl
from .torch_twin import FP8_DTYPES

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("moe_dispatch::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x).quantize_rows(x, fp8_dtype)


@_quantize_rows_op.register_fake
def _(x, fp8_dtype):
    return x.new_empty(tuple(x.shape), dtype=fp8_dtype), x.new_empty((x.shape[0],), dtype=torch.float32)


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of x to float8 with its own scale.

    Args:
        x: [T, H] float32, bfloat16 or float16 (any strides).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        (q [T, H] fp8_dtype, contiguous; scales [T] float32), q[t] * scales[t] ~ x[t]; see the
        module docstring for the exact arithmetic, zero rows and non-finite rows. Pass the scales
        as ``row_scales`` to ``permute`` and on to ``unpermute``. No gradient flows through it.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    x = x.detach()
    if _direct():
        return _impl(x).quantize_rows(x, fp8_dtype)
    return _quantize_rows_op(x, fp8_dtype)


@torch.library.custom_op("moe_dispatch::dequantize_rows", mutates_args=())
def _dequantize_rows_op(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _impl(q).dequantize_rows(q, scales, out_dtype)


@_dequantize_rows_op.register_fake
def _(q, scales, out_dtype):
    return q.new_empty(tuple(q.shape), dtype=out_dtype)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Widen float8 rows by their row scales: ``quantize_rows``' inverse, up to the format's precision.

    Args:
        q: [T, H] float8_e4m3fn or float8_e5m2 (any strides; a row stride above H, e.g. the FP8
            wire's rows read in place, is not copied).
        scales: [T] float32 on q's device, one per row (``quantize_rows``' scales).
        out_dtype: float32, bfloat16 or float16.

    Returns:
        [T, H] out_dtype, contiguous: ``q[t, h] * scales[t]``, one fp32 multiply (q widens exactly),
        then one rounding to out_dtype; a NaN scale (a non-finite row) gives a NaN row. The Triton
        kernel and the torch twin are bitwise alike. No gradient flows through it.
    """
    if not isinstance(q, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"q and scales must be torch.Tensors, got {type(q).__name__} and {type(scales).__name__}")
    if q.dim() != 2 or q.dtype not in FP8_DTYPES:
        raise TypeError(f"q must be a 2-D [T, H] float8_e4m3fn or float8_e5m2 tensor, got {q.dtype} of shape "
                        f"{tuple(q.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (q.shape[0],) or scales.device != q.device:
        raise ValueError(f"scales must be float32 [{q.shape[0]}] (q's rows) on q's device {q.device}, got "
                         f"{scales.dtype} {tuple(scales.shape)} on {scales.device}")
    if out_dtype not in _INPUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
    q, scales = q.detach(), scales.detach().contiguous()
    if _direct():
        return _impl(q).dequantize_rows(q, scales, out_dtype)
    return _dequantize_rows_op(q, scales, out_dtype)


# Experts per call: the kernel's grid runs experts along its second axis (at most 65535).
MAX_GROUPS = 65535
_INDEX_DTYPES = (torch.int32, torch.int64)


@torch.library.custom_op("moe_dispatch::quantize_group_columns", mutates_args=())
def _quantize_group_columns_op(x: torch.Tensor, row_starts: torch.Tensor, padded_starts: torch.Tensor,
                               padded_rows: int, fp8_dtype: torch.dtype,
                               row_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x).quantize_group_columns(x, row_starts, padded_starts, padded_rows, fp8_dtype, row_scales)


@_quantize_group_columns_op.register_fake
def _(x, row_starts, padded_starts, padded_rows, fp8_dtype, row_scales=None):
    return (x.new_empty((x.shape[1], padded_rows), dtype=fp8_dtype),
            x.new_empty((row_starts.shape[0] - 1, x.shape[1]), dtype=torch.float32))


def quantize_group_columns(x: torch.Tensor, row_starts: torch.Tensor, padded_starts: torch.Tensor,
                           padded_rows: int, fp8_dtype: torch.dtype,
                           row_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each expert's block of rows per column, transposed and padded per expert: the
    operands of a grouped GEMM that contracts over rows (the FP8 expert GEMM's weight gradient).

    Args:
        x: [N, C] float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (any strides), expert e's
            rows x[s_e : s_{e+1}].
        row_starts: [E + 1] int32/int64 on x's device, s_0 = 0 <= s_1 <= ... <= s_E = N.
        padded_starts: [E + 1] int32/int64 on x's device, p_0 = 0, p_E = padded_rows and
            p_{e+1} - p_e >= n_e = s_{e+1} - s_e (e.g. n_e rounded up to 16, cumulated).
        padded_rows: P, qt's columns (a host int: the output's shape).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        row_scales: optional [N] float32 on x's device: the values quantised are then
            ``v = x.float() * row_scales[:, None]`` (one fp32 multiply: a float8 x's dequantised
            rows, without materialising them), else v = x.float().

    Returns:
        (qt [C, P] fp8_dtype, contiguous; scales [E, C] float32): ``(qt[:, p_e : p_e + n_e],
        scales[e]) = quantize_rows(v_e.T)`` bitwise (the module docstring's arithmetic per (expert,
        column); an expert of no rows gets scales 1), and qt[:, p_e + n_e : p_{e+1}] is zero. One
        Triton launch on CUDA, with no host read of the starts: on CUDA starts that break the
        contract give unspecified values (every access stays in bounds); the CPU twin raises
        ValueError. No gradient flows through it.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [N, C], got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES + FP8_DTYPES:
        raise TypeError(f"x must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got {x.dtype}")
    for name, starts in (("row_starts", row_starts), ("padded_starts", padded_starts)):
        if not isinstance(starts, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(starts).__name__}")
        if starts.dim() != 1 or not 1 <= starts.shape[0] <= MAX_GROUPS + 1:
            raise ValueError(f"{name} must be 1-D [E + 1] with 0 <= E <= {MAX_GROUPS}, got shape "
                             f"{tuple(starts.shape)}")
        if starts.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {starts.dtype}")
        if starts.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {starts.device}")
    if padded_starts.shape != row_starts.shape:
        raise ValueError(f"padded_starts must have row_starts' shape {tuple(row_starts.shape)}, got "
                         f"{tuple(padded_starts.shape)}")
    if isinstance(padded_rows, bool) or not isinstance(padded_rows, int) or padded_rows < 0:
        raise ValueError(f"padded_rows must be an int >= 0, got {padded_rows!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    if row_scales is not None:
        if not isinstance(row_scales, torch.Tensor):
            raise TypeError(f"row_scales must be a torch.Tensor or None, got {type(row_scales).__name__}")
        if row_scales.dtype != torch.float32:
            raise TypeError(f"row_scales must be float32, got {row_scales.dtype}")
        if row_scales.shape != (x.shape[0],) or row_scales.device != x.device:
            raise ValueError(f"row_scales must be [{x.shape[0]}] (x's rows) on x's device {x.device}, got "
                             f"{tuple(row_scales.shape)} on {row_scales.device}")
        row_scales = row_scales.detach().contiguous()
    x = x.detach()
    row_starts, padded_starts = row_starts.contiguous(), padded_starts.contiguous()
    if _direct():
        return _impl(x).quantize_group_columns(x, row_starts, padded_starts, padded_rows, fp8_dtype, row_scales)
    return _quantize_group_columns_op(x, row_starts, padded_starts, padded_rows, fp8_dtype, row_scales)
