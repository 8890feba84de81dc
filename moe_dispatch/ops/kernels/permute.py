"""Permute (copy each token to its rows) and its backward (sum the rows back in slot order), and
the row gather of sort_chunks, each kernel beside its launcher. The ``slots`` layout and the rules
every kernel keeps: slot_rows.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import guard
from ..torch_twin import block_h, fp8_max
from . import slot_rows
from .float8 import bytes_of, round_out
from .launch import LAUNCH, launch_opts
from .slot_rows import (
    _load_slot_row,
    _num_warps,
    _poisoned,
    _probs_args,
    _row_grid,
    _row_in,
    _token_and_chunk,
    _token_slots,
    zero_uncovered_rows,
)


# --------------------------------------------------------------------------------------------
# Permute: copy each token to its rows; backward sums the rows back in slot order.
# Every kernel below masks each row it reads or writes against the rows allocated, and writes NaN
# once the device's status records a bad input (guard.py).
# --------------------------------------------------------------------------------------------
@triton.jit
def _permute_kernel(
    tokens_ptr, slots_ptr, probs_ptr, scales_ptr, out_ptr, out_probs_ptr, out_scales_ptr, status_ptr,
    T, H, E, N, stride_tt, stride_th, stride_pt, stride_pe,
    HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr, BLOCK_H: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
    BLOCK_K: tl.constexpr, STORE_CM: tl.constexpr, NAN_BITS: tl.constexpr,
):
    """Program (t, c): copy token t's H-chunk c to its n_t rows, BLOCK_K rows per 2-D store (a
    pure copy: no value depends on how the stores are grouped). Rows outside [0, N) are skipped.
    NAN_BITS > 0: the tokens are float8 viewed as bytes, copied as they are (NAN_BITS once poisoned).
    HAS_SCALES: the programs of chunk 0 also copy row_scales[t] (fp32) to the token's rows."""
    t, pid_h, offs_h, mask_h, slot_row, n = _token_slots(slots_ptr, T, H, E, BLOCK_H, TOKEN_MAJOR)
    poisoned = _poisoned(status_ptr)
    raw = tl.load(tokens_ptr + t * stride_tt + offs_h * stride_th, mask=mask_h)
    if NAN_BITS > 0:
        x = tl.where(poisoned, NAN_BITS, raw).to(raw.dtype)
    else:
        x = tl.where(poisoned, float("nan"), raw.to(tl.float32)).to(raw.dtype)
    offs_k = tl.arange(0, BLOCK_K)
    for j0 in range(0, n, BLOCK_K):
        rows = tl.load(slot_row + 1 + j0 + offs_k, mask=j0 + offs_k < n, other=-1).to(tl.int64)
        mask_k = (rows >= 0) & (rows < N)
        tl.store(out_ptr + rows[:, None] * H + offs_h[None, :], tl.broadcast_to(x[None, :], (BLOCK_K, BLOCK_H)),
                 mask=mask_k[:, None] & mask_h[None, :], cache_modifier=STORE_CM)
        if HAS_PROBS:
            if pid_h == 0:
                e = tl.load(slot_row + 1 + E + j0 + offs_k, mask=mask_k, other=0)
                ok = mask_k & (e >= 0) & (e < E)
                p = tl.load(probs_ptr + t * stride_pt + e * stride_pe, mask=ok)
                tl.store(out_probs_ptr + rows, tl.where(poisoned, float("nan"), p), mask=ok)
        if HAS_SCALES:
            if pid_h == 0:
                s = tl.load(scales_ptr + t) + tl.zeros([BLOCK_K], dtype=tl.float32)
                tl.store(out_scales_ptr + rows, tl.where(poisoned, float("nan"), s), mask=mask_k)


def permute_rows(tokens: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor | None,
                 num_out: int, zero_fill: bool, block: int | None = None, num_warps: int | None = None, *,
                 row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher. tokens [T, H] (any token dtype, float8 included), probs [T, E], row_scales [T] fp32
    contiguous -> (out [num_out, H] in tokens.dtype, out_probs [num_out], out_scales [num_out] fp32);
    an absent probs or row_scales gives a [0] fp32 placeholder."""
    T, H = tokens.shape
    E = (slots.shape[1] - 1) // 2
    alloc = torch.zeros if zero_fill else torch.empty
    out = slot_rows.uninitialised_buffer((num_out, H), dtype=tokens.dtype, device=tokens.device)
    if zero_fill:
        zero_uncovered_rows(out, slots)  # the kernel below writes the rest
    out_probs = alloc((num_out if probs is not None else 0,), dtype=torch.float32 if probs is None else probs.dtype,
                      device=tokens.device)
    out_scales = alloc((num_out if row_scales is not None else 0,), dtype=torch.float32, device=tokens.device)
    if T == 0 or H == 0:
        return out, out_probs, out_scales
    bh = block or block_h(H)  # a copy: the block size does not change any value
    p, *p_strides = _probs_args(probs, out_probs)
    src, nan_bits = bytes_of(tokens)
    dst, _ = bytes_of(out)
    _permute_kernel[_row_grid(T, H, bh)](
        src, slots, p, row_scales if row_scales is not None else out_scales, dst, out_probs, out_scales,
        guard.status(tokens.device), T, H, E, num_out, src.stride(0), src.stride(1), *p_strides,
        HAS_PROBS=probs is not None, HAS_SCALES=row_scales is not None, BLOCK_H=bh,
        TOKEN_MAJOR=LAUNCH["token_major"], BLOCK_K=LAUNCH["rows_per_store"],
        STORE_CM=LAUNCH["permute_store_cache"], NAN_BITS=nan_bits, num_warps=num_warps or _num_warps(bh),
        **launch_opts())
    return out, out_probs, out_scales


@triton.jit
def _permute_bwd_kernel(
    grad_ptr, slots_ptr, grad_probs_ptr, grad_tokens_ptr, grad_token_probs_ptr, status_ptr,
    T, H, E, N, stride_gn, stride_gh,
    HAS_PROBS: tl.constexpr, BLOCK_H: tl.constexpr, TOKEN_MAJOR: tl.constexpr, SLOTS_PER_STEP: tl.constexpr,
    OUT_FP8_MAX: tl.constexpr,
):
    t, pid_h, offs_h, mask_h, slot_row, n = _token_slots(slots_ptr, T, H, E, BLOCK_H, TOKEN_MAJOR)
    poisoned = _poisoned(status_ptr)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j0 in range(0, n, SLOTS_PER_STEP):
        for step in tl.static_range(SLOTS_PER_STEP):
            j = j0 + step
            live, row, y = _load_slot_row(grad_ptr, slot_row, j, n, N, H, offs_h, stride_gn, stride_gh)
            acc = tl.where(live, acc + y, acc)
            if HAS_PROBS:
                if pid_h == 0:
                    e = tl.load(slot_row + 1 + E + j, mask=live, other=-1)
                    ok = (row >= 0) & (row < N) & (e >= 0) & (e < E)
                    g = tl.load(grad_probs_ptr + row, mask=ok, other=0.0)
                    tl.store(grad_token_probs_ptr + t * E + e, tl.where(poisoned, float("nan"), g), mask=ok)
    acc = tl.where(poisoned, float("nan"), acc)
    tl.store(grad_tokens_ptr + t * H + offs_h, round_out(acc, grad_tokens_ptr, OUT_FP8_MAX), mask=mask_h)


def permute_rows_backward(grad: torch.Tensor, slots: torch.Tensor, grad_probs: torch.Tensor | None,
                          probs_dtype: torch.dtype, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. grad [N, H], grad_probs [N] -> (grad_tokens [T, H], grad_token_probs [T, E] or [0])."""
    T = slots.shape[0]
    E = (slots.shape[1] - 1) // 2
    N, H = grad.shape
    grad_tokens = torch.empty((T, H), dtype=grad.dtype, device=grad.device)
    if grad_probs is None:
        grad_token_probs = torch.empty(0, dtype=probs_dtype, device=grad.device)
    else:
        grad_token_probs = torch.zeros((T, E), dtype=probs_dtype, device=grad.device)
    if T == 0 or H == 0:
        return grad_tokens.zero_(), grad_token_probs
    bh = block or block_h(H)  # sums over a token's rows per element: the block size changes no value
    gp = grad_probs.to(probs_dtype).contiguous() if grad_probs is not None else grad_token_probs
    _permute_bwd_kernel[_row_grid(T, H, bh)](
        grad, slots, gp, bytes_of(grad_tokens)[0], grad_token_probs, guard.status(grad.device), T, H, E, N,
        grad.stride(0), grad.stride(1),
        HAS_PROBS=grad_probs is not None, BLOCK_H=bh, TOKEN_MAJOR=LAUNCH["token_major"],
        SLOTS_PER_STEP=LAUNCH["slots_per_step"], OUT_FP8_MAX=fp8_max(grad.dtype), num_warps=_num_warps(bh),
        **launch_opts())
    return grad_tokens, grad_token_probs


# --------------------------------------------------------------------------------------------
# Row gather, for sort_chunks: out[r] = x[index[r]] (an index outside [0, N) reads nothing).
# --------------------------------------------------------------------------------------------
@triton.jit
def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, M, N, H, stride_xn, stride_xh, BLOCK_H: tl.constexpr,
                        TOKEN_MAJOR: tl.constexpr):
    r, c = _token_and_chunk(M, H, BLOCK_H, TOKEN_MAJOR)
    offs_h = c * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    src = tl.load(index_ptr + r).to(tl.int64)
    x = tl.load(x_ptr + src * stride_xn + offs_h * stride_xh, mask=offs_h < _row_in(src, N, H), other=0.0)
    tl.store(out_ptr + r * H + offs_h, x, mask=mask_h)


def gather_rows(x: torch.Tensor, index: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Launcher. x [N, H], index [M] int64 -> x[index] [M, H]."""
    M = index.shape[0]
    N, H = x.shape
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0 or H == 0:
        return out
    bh = block or block_h(H)  # a copy: the block size does not change any value
    _gather_rows_kernel[_row_grid(M, H, bh)](x, index, out, M, N, H, x.stride(0), x.stride(1), BLOCK_H=bh,
                                             TOKEN_MAJOR=LAUNCH["token_major"], num_warps=_num_warps(bh))
    return out
