"""Float64 oracle and error bounds for the permutation ops tests.

Bounds (u = unit roundoff of the result dtype, 2^-24 for the fp32 accumulator):
- a sum of K fp32 products rounded once to dtype d:
      |ours - ref| <= half_ulp_d(|ref| + delta) + delta,   delta = K * 2^-24 * sum_j |p_j y_j|
  (fp32 recursive summation error <= (K-1) u32 sum|terms|, plus one u32 per product);
- a single product: one fp32 rounding then one to the result dtype, delta = 2^-24 |ref|;
- the probability gradient, a dot over H in fp32: delta = H * 2^-24 * sum_h |y_h g_h|, plus half
  an fp32 ulp (or fp64's for fp64 probs).
The Triton interpreter rounds fp32 -> bf16/fp16 by truncation, so interpreter checks allow one ulp.
"""
from __future__ import annotations

import math

import torch


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` numbers at magnitude |x| (float64 tensor)."""
    fi = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs().clamp(min=fi.tiny))  # |x| = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, fi.eps / 4), exponent)


def assert_within(ours: torch.Tensor, ref: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype,
                  what: str, ulps: float = 1.0) -> float:
    """|ours - ref| <= ulps * half_ulp(|ref| + delta) + delta elementwise; returns the max error."""
    ours64 = ours.to(torch.float64)
    err = (ours64 - ref).abs()
    bound = ulps * half_ulp(ref.abs() + delta, dtype) + delta
    bad = err > bound
    if bool(bad.any()):
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: error {err[tuple(i)].item():.3e} > bound {bound[tuple(i)].item():.3e} "
                             f"at {i} (ours {ours64[tuple(i)].item()!r}, ref {ref[tuple(i)].item()!r})")
    return float(err.max()) if err.numel() else 0.0


U32 = 2.0 ** -24


def random_routing(T: int, E: int, K: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """[T, E] bool with exactly K distinct experts per token."""
    scores = torch.rand((T, E), generator=gen)
    idx = scores.topk(K, dim=1).indices
    return torch.zeros((T, E), dtype=torch.bool).scatter_(1, idx, True).to(device)


def reference_unpermute(rows64: torch.Tensor, routing_map: torch.Tensor, probs64: torch.Tensor | None,
                        row_of: torch.Tensor):
    """out[t] = sum_e p[t,e] y[row_of[t,e]] in float64, plus sum_e |p y| for the bound.
    row_of: [T, E] int64 permuted row of (t, e), -1 if not routed."""
    T, E = routing_map.shape
    H = rows64.shape[1]
    out = torch.zeros((T, H), dtype=torch.float64)
    mag = torch.zeros((T, H), dtype=torch.float64)
    t_idx, e_idx = routing_map.nonzero(as_tuple=True)
    terms = rows64[row_of[t_idx, e_idx]]
    if probs64 is not None:
        terms = terms * probs64[t_idx, e_idx][:, None]
    out.index_add_(0, t_idx, terms)
    mag.index_add_(0, t_idx, terms.abs())
    return out, mag


def expected_rows(routing_map: torch.Tensor, pad_multiple: int = 1) -> torch.Tensor:
    """[T, E] int64: the permuted row of (t, e) in expert-major, token-ascending order (-1 if none)."""
    T, E = routing_map.shape
    row_of = torch.full((T, E), -1, dtype=torch.int64)
    row = 0
    for e in range(E):
        tokens = routing_map[:, e].nonzero().flatten()
        row_of[tokens, e] = torch.arange(row, row + len(tokens))
        row += math.ceil(len(tokens) / pad_multiple) * pad_multiple
    return row_of
