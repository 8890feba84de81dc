"""Float8 rounding inside Triton kernels, compiled and under ``TRITON_INTERPRET=1``.

``round_out`` gives the bytes of torch_twin.round_to on the GPU and under the interpreter, so
every kernel family that writes float8 (the unpermute sums, the quantisers) rounds alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_twin import FP8_DTYPES


@triton.jit
def _fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """x (fp32, |x| at most the format's largest value) rounded to nearest even onto the grid of a
    float8 format with MANT mantissa bits and smallest normal exponent EMIN, in fp32 arithmetic:
    adding and subtracting c = 2^(u + 23) rounds |x| at the grid's ulp 2^u there (u = max(e, EMIN)
    - MANT for |x| in [2^e, 2^(e+1)); subnormals included)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN), 15)  # 15: a NaN's exponent stays in range
    c = ((e - MANT + 150) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + c) - c
    # x's sign bit put back as a bit: -r is 0 - r, which would turn a negative zero positive.
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_byte(x, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_UNITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """The float8 byte of x (fp32, |x| at most the format's largest value, or NaN), rounded to
    nearest even, built with integer arithmetic (no float8 cast: the interpreter's casts truncate
    and know no NaN). SUB_UNITS = 2^(MANT - EMIN), subnormal steps per unit; MIN_NORMAL = 2^EMIN."""
    r = _fp8_grid(x, MANT, EMIN)
    bits = r.to(tl.int32, bitcast=True)
    a = tl.abs(r)
    small = a < MIN_NORMAL  # False for NaN
    subnormal = (tl.where(small, a, 0.0) * SUB_UNITS).to(tl.int32)  # exact: a multiple of the subnormal step
    normal = ((bits & 0x7FFFFFFF) >> (23 - MANT)) - ((126 + EMIN) << MANT)  # rebias the exponent
    code = tl.where(small, subnormal, normal)
    code = tl.where(a == a, code, 0x7F)  # NaN: exponent and mantissa all ones in both formats
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


# Under TRITON_INTERPRET=1 (read as Triton reads it) the interpreter's float8 casts truncate and
# know no NaN, so round_out builds float8 bytes with integer arithmetic there. A compiled kernel
# casts instead: cvt.rn.satfinite (saturate, round to nearest even, NaN kept) gives the same bytes
# in one instruction per two elements, where the integer route's ~30 instructions an element made
# quantize_rows ALU-bound (BENCHMARKS.md, "The quantisation kernel against its byte floor").
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def round_out(x, out_ptr, FP8_MAX: tl.constexpr):
    """x (fp32) rounded once to out_ptr's dtype. FP8_MAX > 0 (a float8 output, 448 e4m3fn or 57344
    e5m2; out_ptr then points at its bytes): saturated to +-FP8_MAX (NaN kept), then rounded to
    nearest even, so the bytes equal torch_twin.round_to's on the GPU and under the interpreter."""
    if FP8_MAX > 0:
        if INTERPRETED:
            x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))
            if FP8_MAX == 448.0:
                return _fp8_byte(x, 3, -6, 512.0, 0.015625)
            else:
                return _fp8_byte(x, 2, -14, 65536.0, 0.00006103515625)
        elif FP8_MAX == 448.0:
            return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return x.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return x.to(out_ptr.dtype.element_ty)


def bytes_of(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x viewed as bytes, the byte of a NaN) for float8 x, which the copy kernels move unconverted
    and the others write through round_out; (x, 0) otherwise."""
    if x.dtype in FP8_DTYPES:
        return x.view(torch.uint8), 0x7F  # exponent and mantissa all ones: NaN in both formats
    return x, 0

