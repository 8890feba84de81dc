"""Unpermute (each token's fixed-order fp32 weighted sum of its rows, rounded once) and its
backward (row and probability gradients), each kernel beside its launcher. The ``slots`` layout and
the rules every kernel keeps: slot_rows.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import guard
from ..torch_twin import NUMERICS, block_h, fp8_max, max_slots_bound
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
    _slot,
    _token_and_chunk,
    _token_slots,
    zero_uncovered_rows,
)


# --------------------------------------------------------------------------------------------
# Unpermute: fixed-order weighted sum of a token's rows; backward gives row and prob gradients.
# --------------------------------------------------------------------------------------------
@triton.jit
def _row_scale(scales_ptr, row, N, HAS_SCALES: tl.constexpr):
    """row_scales[row] (fp32) for a row in [0, N), 0 outside; 1 without scales."""
    if HAS_SCALES:
        return tl.load(scales_ptr + row, mask=(row >= 0) & (row < N), other=0.0)
    return 1.0


@triton.jit
def _unpermute_kernel(
    rows_ptr, slots_ptr, probs_ptr, scales_ptr, out_ptr, status_ptr,
    T, H, E, N, stride_rn, stride_rh, stride_pt, stride_pe,
    HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_H: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr, BLOCK_E: tl.constexpr, PROBS_WORD: tl.constexpr, FMA: tl.constexpr,
    SLOTS_PER_STEP: tl.constexpr, OUT_FP8_MAX: tl.constexpr,
):
    """Program (t, c): out[t, chunk c] (FMA: torch_twin.NUMERICS["unpermute_fma"]). A row is widened
    to fp32 and, with HAS_SCALES, multiplied by its row scale in fp32 before the weighted sum. With
    probs, the programs of chunk 0 also check token t's whole probs row and set the status word
    PROBS_WORD on a NaN or inf (a plain store of 1)."""
    t, pid_h, offs_h, mask_h, slot_row, n = _token_slots(slots_ptr, T, H, E, BLOCK_H, TOKEN_MAJOR)
    acc_ty = tl.float64 if ACC_FP64 else tl.float32
    acc = tl.zeros([BLOCK_H], dtype=acc_ty)
    if HAS_PROBS:
        if pid_h == 0:
            offs_e = tl.arange(0, BLOCK_E)
            row_p = tl.load(probs_ptr + t * stride_pt + offs_e * stride_pe, mask=offs_e < E, other=0.0)
            nonfinite = tl.max(tl.where(tl.abs(row_p) < float("inf"), 0, 1), axis=0)
            flag = tl.arange(0, 1)
            tl.store(status_ptr + PROBS_WORD + flag, flag + 1, mask=(flag + nonfinite) > 0)
    for j0 in range(0, n, SLOTS_PER_STEP):
        for step in tl.static_range(SLOTS_PER_STEP):
            j = j0 + step
            live, row, y = _load_slot_row(rows_ptr, slot_row, j, n, N, H, offs_h, stride_rn, stride_rh)
            if HAS_SCALES:
                y = y * _row_scale(scales_ptr, row, N, HAS_SCALES)
            y = y.to(acc_ty)
            if HAS_PROBS:
                e = tl.load(slot_row + 1 + E + j, mask=live, other=-1)
                p = tl.load(probs_ptr + t * stride_pt + e * stride_pe, mask=(e >= 0) & (e < E),
                            other=0.0).to(acc_ty)
                if FMA:
                    summed = tl.fma(tl.broadcast_to(p, (BLOCK_H,)), y, acc)
                else:
                    summed = acc + p * y
            else:
                summed = acc + y
            acc = tl.where(live, summed, acc)
    # fp64 results go through fp32 as torch's own fp64 -> half conversion does (same on CPU and GPU).
    out = tl.where(_poisoned(status_ptr), float("nan"), acc.to(tl.float32))
    tl.store(out_ptr + t * H + offs_h, round_out(out, out_ptr, OUT_FP8_MAX), mask=mask_h)


def unpermute_rows(rows: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor | None,
                   block: int | None = None, *, row_scales: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launcher. rows [N, H] (any token dtype), probs [T, E], row_scales [N] fp32 contiguous ->
    out [T, H] in out_dtype (default rows.dtype). On CPU (the interpreter), NaN or inf in probs
    raises at once; on CUDA it sets the status (guard.py)."""
    T = slots.shape[0]
    E = (slots.shape[1] - 1) // 2
    N, H = rows.shape
    out_dtype = out_dtype or rows.dtype
    out = torch.empty((T, H), dtype=out_dtype, device=rows.device)
    if T == 0 or H == 0:
        return out
    # Per-element sums over a token's rows: the block size changes no value, so it is the one
    # BENCHMARKS.md's "Launch defaults" found fastest, not the twin's block_h(H).
    bh = block or max(16, min(2048, triton.next_power_of_2(H)))
    p, *p_strides = _probs_args(probs, out)
    status = guard.status(rows.device)
    _unpermute_kernel[_row_grid(T, H, bh)](
        rows, slots, p, row_scales if row_scales is not None else out, bytes_of(out)[0], status, T, H, E, N,
        rows.stride(0), rows.stride(1), *p_strides,
        HAS_PROBS=probs is not None, HAS_SCALES=row_scales is not None,
        ACC_FP64=probs is not None and probs.dtype == torch.float64,
        BLOCK_H=bh, TOKEN_MAJOR=LAUNCH["token_major"], BLOCK_E=triton.next_power_of_2(E),
        PROBS_WORD=guard.PROBS_UNPERMUTE,
        FMA=probs is not None and probs.dtype == torch.float32 and NUMERICS["unpermute_fma"],
        SLOTS_PER_STEP=LAUNCH["slots_per_step"], OUT_FP8_MAX=fp8_max(out_dtype), num_warps=LAUNCH["warps"] or 4,
        **launch_opts())
    if probs is not None and rows.device.type == "cpu":
        words = status.tolist()
        guard.fail(guard.problems([], 0, words, None, None))
    return out


@triton.jit
def _store_probs_grad(dots, slot_row, n, max_slots, bad, grad_probs_ptr, t, E,
                      BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr):
    """grad_probs[t, e_j] = dots[j] for the token's slots j, 0 for the experts t is not routed to:
    the whole dense row (no separate zero-fill pass over [T, E]); a NaN row when ``bad``."""
    offs_j = tl.arange(0, BLOCK_J)
    e = tl.load(slot_row + 1 + E + offs_j, mask=offs_j < n, other=-1)
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        # Each expert id appears at most once among a token's slots: a select (x + 0s; only the
        # sign of a zero gradient may differ from the twin's, which compares equal).
        hit = e[:, None] == offs_e[None, :]
        picked = tl.max(tl.where(hit, 1, 0), axis=0) > 0
        value = tl.sum(tl.where(hit, dots[:, None], 0.0), axis=0)
        value = tl.where(picked, value, 0.0)
        value = tl.where(bad, float("nan"), value)
        tl.store(grad_probs_ptr + t * E + offs_e, value.to(grad_probs_ptr.dtype.element_ty), mask=offs_e < E)


@triton.jit
def _unpermute_bwd_chunk(
    grad_ptr, rows_ptr, slots_ptr, probs_ptr, scales_ptr, grad_rows_ptr, partial_ptr,
    t, c, slot_row, n, poisoned, dots, H, E, N, max_slots, num_chunks,
    stride_gt, stride_gh, stride_rn, stride_rh, stride_pt, stride_pe,
    HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr, SLOTS_PER_STEP: tl.constexpr, OUT_FP8_MAX: tl.constexpr, STORE_PARTIAL: tl.constexpr,
):
    """Token t's H-chunk c: rows' gradient g * p (times the row scale) and, per slot j, the chunk's
    dot <row_scale * y_row, g>: stored to partial[t, j, c] (STORE_PARTIAL), else added to dots[j]
    (returned). Slots j >= max_slots keep no partial (their token's probs gradient is NaN)."""
    acc_ty = tl.float64 if ACC_FP64 else tl.float32
    offs_h = c * BLOCK_H + tl.arange(0, BLOCK_H)
    g = tl.load(grad_ptr + t * stride_gt + offs_h * stride_gh, mask=offs_h < H, other=0.0)
    g = tl.where(poisoned, float("nan"), g.to(tl.float32))
    offs_j = tl.arange(0, BLOCK_J)
    for j0 in range(0, n, SLOTS_PER_STEP):
        for step in tl.static_range(SLOTS_PER_STEP):
            j = j0 + step
            live, row = _slot(slot_row, j, n)
            mask_row = offs_h < _row_in(row, N, H)
            s = _row_scale(scales_ptr, row, N, HAS_SCALES)
            if HAS_PROBS:
                e = tl.load(slot_row + 1 + E + j, mask=live, other=-1)
                p = tl.load(probs_ptr + t * stride_pt + e * stride_pe, mask=(e >= 0) & (e < E),
                            other=0.0).to(acc_ty)
                g_acc = g.to(acc_ty)
                y = tl.load(rows_ptr + row * stride_rn + offs_h * stride_rh, mask=mask_row, other=0.0).to(tl.float32)
                if HAS_SCALES:
                    y = y * s
                y = y.to(acc_ty)
                g_row = (g_acc * p).to(tl.float32)
                if HAS_SCALES:
                    g_row = g_row * s
                tl.store(grad_rows_ptr + row * H + offs_h, round_out(g_row, grad_rows_ptr, OUT_FP8_MAX),
                         mask=mask_row)
                if STORE_PARTIAL:
                    at = tl.arange(0, 1)
                    tl.store(partial_ptr + (t * max_slots + j) * num_chunks + c + at,
                             tl.sum(y * g_acc, axis=0) + tl.zeros([1], acc_ty), mask=live & ((at + j) < max_slots))
                else:
                    dots = tl.where((offs_j == j) & live, dots + tl.sum(y * g_acc, axis=0), dots)
            else:
                g_row = g
                if HAS_SCALES:
                    g_row = g * s
                tl.store(grad_rows_ptr + row * H + offs_h, round_out(g_row, grad_rows_ptr, OUT_FP8_MAX),
                         mask=mask_row)
    return dots


@triton.jit
def _unpermute_bwd_kernel(
    grad_ptr, rows_ptr, slots_ptr, probs_ptr, scales_ptr, grad_rows_ptr, partial_ptr, grad_probs_ptr, status_ptr,
    T, H, E, N, max_slots, num_chunks, stride_gt, stride_gh, stride_rn, stride_rh, stride_pt, stride_pe,
    HAS_PROBS: tl.constexpr, HAS_SCALES: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_H: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr, SLOTS_PER_STEP: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr, OUT_FP8_MAX: tl.constexpr,
):
    """The unpermute backward, both routes (one body, _unpermute_bwd_chunk, so the same bits):
    - default: program (t, c) does H-chunk c and stores its per-slot partial dots, which
      _probs_grad_kernel sums in chunk order;
    - PER_TOKEN (LAUNCH["unpermute_bwd_per_token"]): program t walks its H-chunks in order, adding
      each chunk's dot to a running sum from 0 (the same additions in the same order), and writes
      the probs gradient itself (no partial buffer, no second launch).

    The in-chunk sum is tl.sum: its order is fixed for a compiled kernel (so results are
    deterministic and independent of T and of other tokens) but it is not the twin's order, so
    the probability gradient matches the twin within rounding, not bitwise (why not a tree the
    twin reproduces: BENCHMARKS.md, "Tuning tried and not kept")."""
    if PER_TOKEN:
        t = tl.program_id(0).to(tl.int64)
    else:
        t, c = _token_and_chunk(T, H, BLOCK_H, TOKEN_MAJOR)
    slot_row = slots_ptr + t * (2 * E + 1)
    n = tl.minimum(tl.maximum(tl.load(slot_row), 0), E)  # clamped as _token_slots does
    poisoned = _poisoned(status_ptr)
    dots = tl.zeros([BLOCK_J], dtype=tl.float64 if ACC_FP64 else tl.float32)
    if PER_TOKEN:
        for c in range(0, tl.cdiv(H, BLOCK_H)):
            dots = _unpermute_bwd_chunk(grad_ptr, rows_ptr, slots_ptr, probs_ptr, scales_ptr, grad_rows_ptr,
                                        partial_ptr, t, c, slot_row, n, poisoned, dots, H, E, N, max_slots, num_chunks,
                                        stride_gt, stride_gh, stride_rn, stride_rh, stride_pt, stride_pe,
                                        HAS_PROBS, HAS_SCALES, ACC_FP64, BLOCK_H, BLOCK_J, SLOTS_PER_STEP,
                                        OUT_FP8_MAX, False)
        if HAS_PROBS:
            _store_probs_grad(dots, slot_row, n, max_slots, poisoned | (n > max_slots), grad_probs_ptr, t, E,
                              BLOCK_J, BLOCK_E)
    else:
        _unpermute_bwd_chunk(grad_ptr, rows_ptr, slots_ptr, probs_ptr, scales_ptr, grad_rows_ptr, partial_ptr,
                             t, c, slot_row, n, poisoned, dots, H, E, N, max_slots, num_chunks,
                             stride_gt, stride_gh, stride_rn, stride_rh, stride_pt, stride_pe,
                             HAS_PROBS, HAS_SCALES, ACC_FP64, BLOCK_H, BLOCK_J, SLOTS_PER_STEP, OUT_FP8_MAX, True)


@triton.jit
def _probs_grad_kernel(partial_ptr, slots_ptr, grad_probs_ptr, status_ptr, E, max_slots, num_chunks,
                       BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr):
    """grad_probs[t, e_j] = sum over chunks c, in order, of partial[t, j, c]; 0 for the experts t
    is not routed to. A token with more than max_slots experts (a max_experts_per_token too small)
    gets a NaN row."""
    t = tl.program_id(0).to(tl.int64)
    slot_row = slots_ptr + t * (2 * E + 1)
    n = tl.minimum(tl.maximum(tl.load(slot_row), 0), E)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = (offs_j < n) & (offs_j < max_slots)
    acc = tl.zeros([BLOCK_J], dtype=partial_ptr.dtype.element_ty)
    for c in range(0, num_chunks):
        acc += tl.load(partial_ptr + (t * max_slots + offs_j) * num_chunks + c, mask=mask_j, other=0.0)
    _store_probs_grad(acc, slot_row, n, max_slots, _poisoned(status_ptr) | (n > max_slots), grad_probs_ptr, t, E,
                      BLOCK_J, BLOCK_E)


def unpermute_rows_backward(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                            probs: torch.Tensor | None, zero_fill: bool, max_slots: int,
                            block: int | None = None, *,
                            row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. grad [T, H] (any token dtype), rows [N, H], probs [T, E], row_scales [N] fp32
    contiguous -> (grad_rows [N, H] in rows.dtype, grad_probs [T, E] or [0]). max_slots bounds n_t
    (the most experts of any token). block: the H-chunk of the probs gradient's partial sums
    (default block_h(H), the twin's); another block changes how the probs gradient rounds (not the
    rows' gradient), so only scripts/tune_ops.py passes one."""
    T = slots.shape[0]
    E = (slots.shape[1] - 1) // 2
    N, H = rows.shape
    grad_rows = slot_rows.uninitialised_buffer((N, H), dtype=rows.dtype, device=rows.device)
    if zero_fill:
        zero_uncovered_rows(grad_rows, slots)  # the kernel below writes the rest
    if probs is None:
        grad_probs = torch.empty(0, dtype=torch.float32, device=rows.device)
    else:
        # Probabilities of slots nobody chose get a zero gradient (written by _store_probs_grad).
        grad_probs = torch.empty((T, E), dtype=probs.dtype, device=rows.device)
    if T == 0 or H == 0:
        return grad_rows, grad_probs.zero_()
    bh = block or block_h(H)
    num_chunks = triton.cdiv(H, bh)
    max_slots = max_slots_bound(max_slots, E)
    acc_dtype = torch.float64 if probs is not None and probs.dtype == torch.float64 else torch.float32
    p, *p_strides = _probs_args(probs, grad_probs)
    status = guard.status(rows.device)
    per_token = LAUNCH["unpermute_bwd_per_token"]
    partial = torch.empty((T, max_slots, num_chunks) if probs is not None and not per_token else (0,),
                          dtype=acc_dtype, device=rows.device)
    block_j, block_e = triton.next_power_of_2(max_slots), min(256, triton.next_power_of_2(E))
    _unpermute_bwd_kernel[(T,) if per_token else _row_grid(T, H, bh)](
        grad, rows, slots, p, row_scales if row_scales is not None else grad_probs, bytes_of(grad_rows)[0], partial,
        grad_probs,
        status, T, H, E, N, max_slots, num_chunks,
        grad.stride(0), grad.stride(1), rows.stride(0), rows.stride(1), *p_strides,
        HAS_PROBS=probs is not None, HAS_SCALES=row_scales is not None, ACC_FP64=acc_dtype == torch.float64,
        BLOCK_H=bh, TOKEN_MAJOR=LAUNCH["token_major"], SLOTS_PER_STEP=LAUNCH["unpermute_bwd_slots_per_step"],
        PER_TOKEN=per_token, BLOCK_J=block_j, BLOCK_E=block_e, OUT_FP8_MAX=fp8_max(rows.dtype),
        num_warps=_num_warps(bh), **launch_opts())
    if probs is not None and not per_token:
        _probs_grad_kernel[(T,)](partial, slots, grad_probs, status, E, max_slots, num_chunks,
                                 BLOCK_J=block_j, BLOCK_E=block_e, num_warps=LAUNCH["probs_grad_warps"],
                                 **launch_opts())
    return grad_rows, grad_probs
