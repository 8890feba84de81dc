"""Row-stable activations and the Megatron-style per-row prob scaling.

Why not plain ``F.gelu``/``F.silu`` on CPU: torch's CPU kernels run a SIMD body and a scalar
tail (the last ``n % (2 * vector width)`` elements of each thread's chunk), and the two use
different exp/erf code. Which elements land in a tail depends on the tensor's size and the thread
split, so a row's activation changed with the number of rows (seen here for silu, sigmoid and
gelu, fp32 and bf16). On CPU we therefore build exp and erfc from correctly rounded operations
only (+, -, *, /, round, integer bit tricks), each a separate torch op so no fused multiply-add
creeps in: SIMD and scalar code then give the same bits. CUDA elementwise kernels apply one
device function to every element whatever the vectorisation, so CUDA uses the native ops
(tests/experts/test_gpu.py checks it).

The CPU formulas run in float64 and are rounded once to float32 (then to the tensor's dtype):
exp is good to 3e-13, so silu is accurate to the last float32 bit or two; gelu's erfc carries a relative
error below 1.2e-7
(about one float32 ulp). float64 tensors use the native ops (reference use; no row-stability
promise in float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..numerics.autograd import refuse_double_backward
from ..numerics.fixed_order import tree_sum

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693147180369123816490  # high bits of ln 2: n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# Taylor coefficients 1/k! for exp(r), |r| <= ln2/2, up to k=10: the first omitted term is below
# 3e-13 relative, far under the float32 rounding that follows.
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(10, -1, -1)]
# Chebyshev fit of erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0 (relative error < 1.2e-7).
_ERFC_COEFFS = [0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                0.09678418, 0.37409196, 1.00002368, -1.26551223]


def _exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor from exact IEEE ops: 2**n * exp(r), r = x - n ln2."""
    x = x.clamp(-708.0, 709.0)  # keeps 2**n a normal float64
    n = torch.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    two_n = torch.bitwise_left_shift(n.to(torch.int64) + 1023, 52).view(torch.float64)
    return p * two_n


def _sigmoid64(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + _exp64(-x))


def _phi64(x: torch.Tensor) -> torch.Tensor:
    """Standard normal CDF of a float64 tensor, via erfc so both tails keep relative accuracy."""
    z = x.abs() * _INV_SQRT2
    t = 1.0 / (1.0 + 0.5 * z)
    p = torch.full_like(t, _ERFC_COEFFS[0])
    for c in _ERFC_COEFFS[1:]:
        p = p * t + c
    half_erfc = 0.5 * (t * _exp64(p - z * z))  # = Phi(-|x|)
    return torch.where(x < 0, half_erfc, 1.0 - half_erfc)


def _round(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # float64 -> float32 -> dtype: two round-to-nearest-even casts, identical in SIMD and scalar code.
    return _cast(y64.to(torch.float32), dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, never t itself through a no-op ``.to``: torch 2.11's dynamo traces an
    autograd.Function whose forward returns a tensor an op returned as itself with a zero gradient."""
    return t if t.dtype == dtype else t.to(dtype)


def _silu64(x: torch.Tensor) -> torch.Tensor:
    return x * _sigmoid64(x)


def _silu_grad64(x: torch.Tensor) -> torch.Tensor:
    s = _sigmoid64(x)
    return s * (1.0 + x * (1.0 - s))


def _gelu64(x: torch.Tensor) -> torch.Tensor:
    return x * _phi64(x)


def _gelu_grad64(x: torch.Tensor) -> torch.Tensor:
    return _phi64(x) + x * (_INV_SQRT_2PI * _exp64(-0.5 * (x * x)))


_CPU_FORMULAS = {"silu": (_silu64, _silu_grad64), "gelu": (_gelu64, _gelu_grad64)}


class _ExactActivation(torch.autograd.Function):
    """CPU activation whose forward and backward use only exact IEEE operations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.name = name
        return _round(_CPU_FORMULAS[name][0](x.to(torch.float64)), x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("_ExactActivation")
        (x,) = ctx.saved_tensors
        dydx = _CPU_FORMULAS[ctx.name][1](x.to(torch.float64))
        return _round(grad.to(torch.float64) * dydx, x.dtype), None


def _unary(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype != torch.float64:
        return _ExactActivation.apply(x, name)
    return F.silu(x) if name == "silu" else F.gelu(x)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """fc1 output [N, fc1_out] -> [N, ffn], elementwise per row, in h's dtype.

    ``swiglu`` splits fc1's output into halves (gate, up) as Megatron's ``glu`` does (the first
    half goes through silu) and rounds silu(gate) before the product, as Megatron's unfused path.
    """
    if activation == "relu":
        return F.relu(h)  # max(x, 0) is exact on every path
    if activation == "gelu":
        return _unary(h, "gelu")
    if activation == "swiglu":
        gate, up = torch.chunk(h, 2, dim=-1)
        return _unary(gate, "silu") * up
    raise ValueError(f"unknown activation {activation!r}")


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree of elementwise adds: [N, F] -> [N]
    (a row's sum then cannot change with N, as torch's reduction kernels' can)."""
    return tree_sum(x, dim=-1)


class _ScaleRows(torch.autograd.Function):
    """``(act * probs[:, None])`` in float32 (at least), rounded once to act's dtype."""

    @staticmethod
    def forward(ctx, act: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(act, probs)
        ct = torch.promote_types(torch.promote_types(act.dtype, probs.dtype), torch.float32)
        return _cast(act.to(ct) * probs.to(ct).unsqueeze(-1), act.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("_ScaleRows")
        act, probs = ctx.saved_tensors
        ct = torch.promote_types(torch.promote_types(act.dtype, probs.dtype), torch.float32)
        g = grad.to(ct)
        grad_act = (g * probs.to(ct).unsqueeze(-1)).to(act.dtype) if ctx.needs_input_grad[0] else None
        grad_probs = _row_sum(g * act.to(ct)).to(probs.dtype) if ctx.needs_input_grad[1] else None
        return grad_act, grad_probs


def scale_rows(act: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Megatron's expert-side prob weighting: act [N, F] times probs [N], one rounding.

    The probs gradient sums over F with `_row_sum`, so it is row-stable too.
    """
    return _ScaleRows.apply(act, probs)
