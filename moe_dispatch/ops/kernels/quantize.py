"""Triton kernels of the float8 quantisation family, each beside its launcher: row-wise
quantisation, row-wise dequantisation, and per-(expert, column) quantisation of the FP8 expert
GEMM's wgrad operands. Their pure-torch twins are the functions of the same names in
torch_twin.py, and the kernels compute the same fp32 operations (ops/quantize.py is the API).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import torch_twin
from ..torch_twin import fp8_max
from .float8 import INTERPRETED, bytes_of, round_out
from .launch import LAUNCH, launch_opts


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs on the CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# --------------------------------------------------------------------------------------------
# Row-wise float8 quantisation (ops/quantize.py): the same fp32 operations as the twin.
# --------------------------------------------------------------------------------------------
# "quantize_elements": elements per row block (whole rows of H <= it load once; longer rows are
# read twice, in chunks of it); "quantize_warps"; "quantize_programs_per_sm": 0 launches one
# program per row block, n > 0 launches n programs per SM that stride over the blocks, asking
# Triton to pipeline their loads "quantize_stages" deep (on an H200 no faster: BENCHMARKS.md, FP8).
# None changes a value: a row's amax is a max (exact in any order) and every element is
# quantised alone.
LAUNCH.update({"quantize_elements": 2048, "quantize_warps": 4, "quantize_programs_per_sm": 0,
               "quantize_stages": 1})


@triton.jit
def _load_rows(x_ptr, offs_t, mask_t, h0, H, stride_xt, stride_xh, BLOCK_H: tl.constexpr):
    """x [BLOCK_T, BLOCK_H] fp32: columns h0.. of the rows offs_t (0.0 where masked)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = mask_t[:, None] & (offs_h < H)[None, :]
    return tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :] * stride_xh, mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _abs_or_inf(x):
    """|x| with NaN counted as inf: a row's max of it is inf exactly when the row holds inf or NaN."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _scale_and_inverse(amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """(bad int32, scale, inv) for a vector of amax (NaN counted as inf): scale = div_rn(amax, FP8_MAX)
    and inv = div_rn(FP8_MAX, amax), both 1 below AMAX_FLOOR; bad = 1 where amax is inf, and there
    the scale is NaN (the quantised values are zeros)."""
    bad = (amax == float("inf")).to(tl.int32)
    top = tl.full(amax.shape, FP8_MAX, tl.float32)
    small = amax < AMAX_FLOOR
    scale = tl.where(small, 1.0, tl.math.div_rn(amax, top))
    inv = tl.where(small, 1.0, tl.math.div_rn(top, tl.where(small, 1.0, amax)))
    return bad, tl.where(bad == 0, scale, float("nan")), inv


@triton.jit
def _store_quantized(x, inv, bad, q_ptr, offs_t, mask_t, h0, H, FP8_MAX: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = mask_t[:, None] & (offs_h < H)[None, :]
    q = tl.where((bad == 0)[:, None], x * inv[:, None], 0.0)
    tl.store(q_ptr + offs_t[:, None] * H + offs_h[None, :], round_out(q, q_ptr, FP8_MAX), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scales_ptr, T, H, stride_xt, stride_xh, FP8_MAX: tl.constexpr,
                          AMAX_FLOOR: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                          ONE_PASS: tl.constexpr, STAGES: tl.constexpr):
    """Row blocks pid, pid + programs, ... of BLOCK_T rows each: amax over the row, scale =
    div_rn(amax, FP8_MAX), inv = div_rn(FP8_MAX, amax) (both 1 below AMAX_FLOOR), q =
    round_out(x * inv); a row holding inf or NaN gets scale NaN and q zeros
    (torch_twin.quantize_rows). ONE_PASS: the row fits one block (BLOCK_H >= H) and is read once;
    otherwise twice, in blocks."""
    blocks = tl.cdiv(T, BLOCK_T)
    for block in tl.range(tl.program_id(0), blocks, tl.num_programs(0), num_stages=STAGES):
        offs_t = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # < T + BLOCK_T: no int32 overflow
        mask_t = offs_t < T
        if ONE_PASS:
            x = _load_rows(x_ptr, offs_t, mask_t, 0, H, stride_xt, stride_xh, BLOCK_H)
            amax = tl.max(_abs_or_inf(x), axis=1)
        else:
            # an elementwise running max, reduced across the warps once at the end (a max: exact, in
            # any order)
            running = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                x = _load_rows(x_ptr, offs_t, mask_t, h0, H, stride_xt, stride_xh, BLOCK_H)
                running = tl.maximum(running, _abs_or_inf(x))
            amax = tl.max(running, axis=1)
        bad, scale, inv = _scale_and_inverse(amax, FP8_MAX, AMAX_FLOOR)
        tl.store(scales_ptr + offs_t, scale, mask=mask_t)
        if ONE_PASS:
            _store_quantized(x, inv, bad, q_ptr, offs_t, mask_t, 0, H, FP8_MAX, BLOCK_H)
        else:
            for h0 in range(0, H, BLOCK_H):
                x = _load_rows(x_ptr, offs_t, mask_t, h0, H, stride_xt, stride_xh, BLOCK_H)
                _store_quantized(x, inv, bad, q_ptr, offs_t, mask_t, h0, H, FP8_MAX, BLOCK_H)


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. x [T, H] fp32/bf16/fp16 -> (q [T, H] fp8_dtype, scales [T] fp32); torch_twin.quantize_rows
    states the arithmetic."""
    T, H = x.shape
    q = torch.empty((T, H), dtype=fp8_dtype, device=x.device)
    scales = torch.empty(T, dtype=torch.float32, device=x.device)
    if T == 0 or H == 0:
        return q, scales.fill_(1.0)
    elements = LAUNCH["quantize_elements"]
    one_pass = H <= elements
    block_h = triton.next_power_of_2(H) if one_pass else elements
    block_t = max(1, elements // block_h)
    programs = triton.cdiv(T, block_t)
    if LAUNCH["quantize_programs_per_sm"] > 0:
        programs = min(programs, LAUNCH["quantize_programs_per_sm"] * _sm_count(x.device))
    _quantize_rows_kernel[(programs,)](
        x, bytes_of(q)[0], scales, T, H, x.stride(0), x.stride(1), FP8_MAX=fp8_max(fp8_dtype),
        AMAX_FLOOR=torch_twin.AMAX_FLOOR, BLOCK_T=block_t, BLOCK_H=block_h, ONE_PASS=one_pass,
        STAGES=LAUNCH["quantize_stages"], num_warps=LAUNCH["quantize_warps"], **launch_opts())
    return q, scales


# --------------------------------------------------------------------------------------------
# Row-wise dequantisation (ops/quantize.py's dequantize_rows): the FP8 experts' saved rows widened
# for a weight gradient in the gradient's dtype (MoEConfig.fp8_wgrad=False).
# --------------------------------------------------------------------------------------------
# Rows and columns per program; no setting changes a value (every element is computed alone).
LAUNCH.update({"dequantize_block_t": 4, "dequantize_block_h": 1024, "dequantize_warps": 4})


@triton.jit
def _dequantize_rows_kernel(q_ptr, scales_ptr, out_ptr, T, H, stride_qt, X_FP8_MAX: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, h] = float(q[t, h]) * scales[t] (one fp32 multiply), rounded once to out's dtype, for
    rows program_id(0) * BLOCK_T + [0, BLOCK_T) and columns program_id(1) * BLOCK_H + [0, BLOCK_H);
    q [T, H] float8 with unit column stride, out [T, H] contiguous (torch_twin.dequantize_rows)."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_h < H)[None, :]
    x = tl.load(q_ptr + offs_t[:, None] * stride_qt + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    if INTERPRETED:
        x = _interpreted_fp8_specials(x, X_FP8_MAX)
    scale = tl.load(scales_ptr + offs_t, mask=mask_t, other=0.0)
    tl.store(out_ptr + offs_t[:, None] * H + offs_h[None, :], round_out(x * scale[:, None], out_ptr, 0.0), mask=mask)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Launcher. q [T, H] float8 (unit column stride, any row stride), scales [T] fp32 contiguous ->
    [T, H] out_dtype contiguous; torch_twin.dequantize_rows states the arithmetic."""
    T, H = q.shape
    out = torch.empty((T, H), dtype=out_dtype, device=q.device)
    if T == 0 or H == 0:
        return out
    if q.stride(1) != 1:
        q = q.contiguous()
    block_t, block_h = LAUNCH["dequantize_block_t"], min(LAUNCH["dequantize_block_h"], triton.next_power_of_2(H))
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    _dequantize_rows_kernel[grid](q, scales, out, T, H, q.stride(0), X_FP8_MAX=fp8_max(q.dtype), BLOCK_T=block_t,
                                  BLOCK_H=block_h, num_warps=LAUNCH["dequantize_warps"], **launch_opts())
    return out


# --------------------------------------------------------------------------------------------
# Per-(expert, column) float8 quantisation (ops/quantize.py's quantize_group_columns): the wgrad
# operands of the FP8 expert GEMM, transposed and padded per expert, in one launch.
# --------------------------------------------------------------------------------------------
# "group_columns_block_c" / "group_columns_block_r": columns per program and rows per step of its
# two passes over the expert's rows; "group_columns_warps"; "group_columns_splits" S: each
# expert's rows are split into S slices, one program each (S > 1 adds a first kernel for the
# slices' column maxima, so that an expert holding many rows no longer sets the end time alone).
# None changes a value: a column's amax is a max (exact in any order) and every element is quantised
# alone.
# "group_columns_tiles": the tiled route instead: every group's padded width cut into tiles of
# block_r rows, one program per (tile, column block) in each of three kernels (the tiles' column
# maxima, each group's scales from its tiles' maxima, the cast), so every program does the same
# small amount of work whatever the split of the rows.
LAUNCH.update({"group_columns_block_c": 64, "group_columns_block_r": 128, "group_columns_warps": 4,
               "group_columns_splits": 1, "group_columns_tiles": False})


@triton.jit
def _interpreted_fp8_specials(x, X_FP8_MAX: tl.constexpr):
    """x widened from float8 by the interpreter, which reads the all-ones exponent as a normal one
    (e4m3fn's NaN as +-480; e5m2's inf as +-65536 and its NaNs above): the formats' NaN and inf put
    back, as a compiled kernel's cast and torch give them."""
    a = tl.abs(x)
    if X_FP8_MAX == 448.0:
        return tl.where(a > X_FP8_MAX, float("nan"), x)
    else:
        special = tl.where(a == 65536.0, tl.where(x > 0, float("inf"), -float("inf")), float("nan"))
        return tl.where(a > X_FP8_MAX, special, x)


@triton.jit
def _group_rows(x_ptr, rs_ptr, s, rows, r0, N, offs_c, mask_c, stride_xn, stride_xc, BLOCK_R: tl.constexpr,
                HAS_SCALES: tl.constexpr, X_FP8_MAX: tl.constexpr):
    """(x [BLOCK_R, BLOCK_C] fp32, the expert's row numbers r0 + [0, BLOCK_R)): rows s + r (r below
    the expert's rows and s + r in [0, N)) of columns offs_c, widened to fp32 (X_FP8_MAX > 0: x is
    float8 of that largest value) and, with HAS_SCALES, times the row's scale (one fp32 multiply);
    +0.0 elsewhere."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    row = s + offs_r
    live = (offs_r < rows) & (row >= 0) & (row < N)
    mask = live[:, None] & mask_c[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_xn + offs_c[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if X_FP8_MAX > 0:
        if INTERPRETED:
            x = _interpreted_fp8_specials(x, X_FP8_MAX)
    if HAS_SCALES:
        x = x * tl.load(rs_ptr + row, mask=live, other=0.0)[:, None]
    return x, offs_r


@triton.jit
def _slice_of(n, split, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """[begin, end) of slice `split` of n rows cut into SPLITS slices of whole BLOCK_R steps (so
    that no step of one slice reaches into the next)."""
    size = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_R) * BLOCK_R
    begin = split * size
    return begin, tl.minimum(n, begin + size)


@triton.jit
def _slice_amax(x_ptr, rs_ptr, s, rows, begin, end, N, offs_c, mask_c, stride_xn, stride_xc,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SCALES: tl.constexpr, X_FP8_MAX: tl.constexpr):
    """max |x| over the expert's rows [begin, end) of columns offs_c, NaN counted as inf (so a
    column is non-finite exactly when its max is inf): an elementwise running max, reduced over the
    rows once at the end (no cross-warp reduction per step). A max is exact in any order."""
    running = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(begin, end, BLOCK_R):
        x, _ = _group_rows(x_ptr, rs_ptr, s, rows, r0, N, offs_c, mask_c, stride_xn, stride_xc, BLOCK_R,
                           HAS_SCALES, X_FP8_MAX)
        running = tl.maximum(running, _abs_or_inf(x))
    return tl.max(running, axis=0)


@triton.jit
def _group_program(starts_ptr, C, BLOCK_C: tl.constexpr):
    """This program's (expert e, slice, experts E, columns offs_c, their mask, the expert's first
    row s_e and its row count) on the group-column kernels' grid (column blocks, E, slices)."""
    e = tl.program_id(1).to(tl.int64)
    offs_c = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.load(starts_ptr + e).to(tl.int64)
    rows = tl.load(starts_ptr + e + 1).to(tl.int64) - s
    return e, tl.program_id(2), tl.num_programs(1), offs_c, offs_c < C, s, rows


@triton.jit
def _group_columns_amax_kernel(x_ptr, row_scales_ptr, starts_ptr, partial_ptr, N, C, stride_xn, stride_xc,
                               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SPLITS: tl.constexpr,
                               HAS_SCALES: tl.constexpr, X_FP8_MAX: tl.constexpr):
    """Expert e = program_id(1), slice program_id(2) of its rows, columns program_id(0) * BLOCK_C +
    [0, BLOCK_C): the slice's column amax (_slice_amax) into partial [SPLITS, E, C]."""
    e, split, E, offs_c, mask_c, s, rows = _group_program(starts_ptr, C, BLOCK_C)
    begin, end = _slice_of(rows, split, SPLITS, BLOCK_R)
    amax = _slice_amax(x_ptr, row_scales_ptr, s, rows, begin, end, N, offs_c, mask_c, stride_xn, stride_xc, BLOCK_R,
                       BLOCK_C, HAS_SCALES, X_FP8_MAX)
    tl.store(partial_ptr + (split * E + e) * C + offs_c, amax, mask=mask_c)


@triton.jit
def _quantize_group_columns_kernel(x_ptr, row_scales_ptr, starts_ptr, pstarts_ptr, partial_ptr, qt_ptr, scales_ptr,
                                   N, C, P, stride_xn, stride_xc, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SPLITS: tl.constexpr,
                                   HAS_SCALES: tl.constexpr, X_FP8_MAX: tl.constexpr):
    """Expert e = program_id(1), slice program_id(2) of its padded width, columns program_id(0) *
    BLOCK_C + [0, BLOCK_C): the column amax over the expert's rows [s_e, s_{e+1}) (times their row
    scales with HAS_SCALES; SPLITS == 1: computed here, else the max of the SPLITS slices' partial
    maxima); scale and inv as in _quantize_rows_kernel (slice 0 stores the scales); then q =
    round_out(x * inv) transposed into qt's columns [p_e, p_e + n_e), +0.0 up to p_{e+1}
    (torch_twin.quantize_group_columns). Every load is masked to [0, N) x [0, C) and every store to
    [0, C) x [0, P), so starts that break the op's contract stay in bounds."""
    e, split, E, offs_c, mask_c, s, rows = _group_program(starts_ptr, C, BLOCK_C)
    p = tl.load(pstarts_ptr + e).to(tl.int64)
    width = tl.load(pstarts_ptr + e + 1).to(tl.int64) - p
    if SPLITS == 1:
        amax = _slice_amax(x_ptr, row_scales_ptr, s, rows, 0, rows, N, offs_c, mask_c, stride_xn, stride_xc,
                           BLOCK_R, BLOCK_C, HAS_SCALES, X_FP8_MAX)
    else:
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(SPLITS):
            amax = tl.maximum(amax, tl.load(partial_ptr + (k * E + e) * C + offs_c, mask=mask_c, other=0.0))
    bad, scale, inv = _scale_and_inverse(amax, FP8_MAX, AMAX_FLOOR)
    tl.store(scales_ptr + e * C + offs_c, scale, mask=mask_c & (split == 0))
    begin, end = _slice_of(width, split, SPLITS, BLOCK_R)
    for j0 in range(begin, end, BLOCK_R):
        x, offs_j = _group_rows(x_ptr, row_scales_ptr, s, rows, j0, N, offs_c, mask_c, stride_xn, stride_xc,
                                BLOCK_R, HAS_SCALES, X_FP8_MAX)
        q = tl.where((bad == 0)[None, :], x * inv[None, :], 0.0)  # rows past n_e: +0.0 * inv = +0.0
        col = p + offs_j
        mask = mask_c[:, None] & ((offs_j < end) & (col >= 0) & (col < P))[None, :]
        tl.store(qt_ptr + offs_c[:, None] * P + col[None, :], tl.trans(round_out(q, qt_ptr, FP8_MAX)), mask=mask)


@triton.jit
def _group_tile(tile_ends_ptr, G, C, LOG2_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (tile k, group g, the tile's first position j0 in the group's padded width,
    live, columns offs_c, their mask) on the tiled route's 1-D grid of (tile, column block)
    programs, column blocks fastest (neighbouring programs read neighbouring columns of the same
    rows). tile_ends [G] int64: the groups' cumulative tile counts; g is the first group whose end
    exceeds k (a binary search of LOG2_G steps); live: k lies before the last group's end."""
    blocks_c = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0).to(tl.int64)
    k = pid // blocks_c
    offs_c = (pid % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    lo = k * 0
    hi = lo + G
    for _ in tl.static_range(LOG2_G):
        active = lo < hi
        mid = (lo + hi) // 2
        right = active & (tl.load(tile_ends_ptr + mid, mask=active, other=0) <= k)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    live = lo < G
    g = tl.minimum(lo, G - 1)
    first = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
    return k, g, (k - first) * BLOCK_R, live, offs_c, offs_c < C


@triton.jit
def _quantize_tiles_amax_kernel(x_ptr, row_scales_ptr, starts_ptr, tile_ends_ptr, partial_ptr, N, C, G, stride_xn,
                                stride_xc, LOG2_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                HAS_SCALES: tl.constexpr, X_FP8_MAX: tl.constexpr):
    """Tile k of group g: partial[k, offs_c] = max |v| over the group's rows in the tile (positions
    j0 + [0, BLOCK_R) below n_g; NaN counted as inf; 0.0 with no such row)."""
    k, g, j0, live, offs_c, mask_c = _group_tile(tile_ends_ptr, G, C, LOG2_G, BLOCK_R, BLOCK_C)
    s = tl.load(starts_ptr + g).to(tl.int64)
    rows = tl.where(live, tl.load(starts_ptr + g + 1).to(tl.int64) - s, 0)
    x, _ = _group_rows(x_ptr, row_scales_ptr, s, rows, j0, N, offs_c, mask_c, stride_xn, stride_xc, BLOCK_R,
                       HAS_SCALES, X_FP8_MAX)
    tl.store(partial_ptr + k * C + offs_c, tl.max(_abs_or_inf(x), axis=0), mask=mask_c & live)


@triton.jit
def _quantize_tiles_scales_kernel(partial_ptr, tile_ends_ptr, scales_ptr, inv_ptr, C, FP8_MAX: tl.constexpr,
                                  AMAX_FLOOR: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Group g = pid // column blocks: the column amax over its tiles' partial maxima (a max: exact
    in any order), then scales[g] and inv[g] (_scale_and_inverse; inv NaN where the column is not
    finite, which tells the cast to write zeros)."""
    blocks_c = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0).to(tl.int64)
    g = pid // blocks_c
    offs_c = (pid % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    first = tl.load(tile_ends_ptr + g - 1, mask=g > 0, other=0)
    last = tl.load(tile_ends_ptr + g)
    running = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    for k0 in range(first, last, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        part = tl.load(partial_ptr + offs_k[:, None] * C + offs_c[None, :],
                       mask=(offs_k < last)[:, None] & mask_c[None, :], other=0.0)
        running = tl.maximum(running, part)
    bad, scale, inv = _scale_and_inverse(tl.max(running, axis=0), FP8_MAX, AMAX_FLOOR)
    tl.store(scales_ptr + g * C + offs_c, scale, mask=mask_c)
    tl.store(inv_ptr + g * C + offs_c, tl.where(bad == 0, inv, float("nan")), mask=mask_c)


@triton.jit
def _quantize_tiles_cast_kernel(x_ptr, row_scales_ptr, starts_ptr, pstarts_ptr, tile_ends_ptr, inv_ptr, qt_ptr,
                                N, C, P, G, stride_xn, stride_xc, FP8_MAX: tl.constexpr, LOG2_G: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SCALES: tl.constexpr,
                                X_FP8_MAX: tl.constexpr):
    """Tile k of group g: q = round_out(v * inv[g]) (zeros where inv is NaN, and +0.0 past the
    group's rows) transposed into qt's columns p_g + j0 + [0, BLOCK_R) below the group's padded
    width; stores masked to [0, C) x [0, P)."""
    k, g, j0, live, offs_c, mask_c = _group_tile(tile_ends_ptr, G, C, LOG2_G, BLOCK_R, BLOCK_C)
    s = tl.load(starts_ptr + g).to(tl.int64)
    rows = tl.where(live, tl.load(starts_ptr + g + 1).to(tl.int64) - s, 0)
    p = tl.load(pstarts_ptr + g).to(tl.int64)
    width = tl.where(live, tl.load(pstarts_ptr + g + 1).to(tl.int64) - p, 0)
    inv = tl.load(inv_ptr + g * C + offs_c, mask=mask_c, other=1.0)
    x, offs_j = _group_rows(x_ptr, row_scales_ptr, s, rows, j0, N, offs_c, mask_c, stride_xn, stride_xc, BLOCK_R,
                            HAS_SCALES, X_FP8_MAX)
    q = tl.where((inv == inv)[None, :], x * inv[None, :], 0.0)  # rows past n_g: +0.0 * inv = +0.0
    col = p + offs_j
    mask = mask_c[:, None] & ((offs_j < width) & (col >= 0) & (col < P))[None, :]
    tl.store(qt_ptr + offs_c[:, None] * P + col[None, :], tl.trans(round_out(q, qt_ptr, FP8_MAX)), mask=mask)


def _quantize_group_columns_tiled(x: torch.Tensor, row_starts: torch.Tensor, padded_starts: torch.Tensor,
                                  qt: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor | None) -> None:
    """The tiled route of quantize_group_columns (LAUNCH["group_columns_tiles"]), into qt and scales.
    Group g's padded width w_g takes max(1, ceil(w_g / block_r)) tiles, at most ceil(P / block_r) + G
    in all (P = qt's columns; a starts tensor that breaks the contract may want more, and the tiles
    past that bound are not run: unspecified values, in bounds)."""
    N, C = x.shape
    G, P = row_starts.shape[0] - 1, qt.shape[1]
    block_c, block_r = LAUNCH["group_columns_block_c"], LAUNCH["group_columns_block_r"]
    widths = torch.diff(padded_starts.to(torch.int64)).clamp(min=1)
    tile_ends = torch.cumsum(torch.div(widths + block_r - 1, block_r, rounding_mode="floor"), 0)
    tiles = triton.cdiv(P, block_r) + G
    blocks_c = triton.cdiv(C, block_c)
    partial = torch.empty((tiles, C), dtype=torch.float32, device=x.device)
    inv = torch.empty((G, C), dtype=torch.float32, device=x.device)
    rs = row_scales if row_scales is not None else scales  # not read without HAS_SCALES
    common = dict(BLOCK_R=block_r, BLOCK_C=block_c, HAS_SCALES=row_scales is not None, X_FP8_MAX=fp8_max(x.dtype),
                  LOG2_G=G.bit_length(), num_warps=LAUNCH["group_columns_warps"], **launch_opts())
    _quantize_tiles_amax_kernel[(tiles * blocks_c,)](x, rs, row_starts, tile_ends, partial, N, C, G, x.stride(0),
                                                     x.stride(1), **common)
    _quantize_tiles_scales_kernel[(G * blocks_c,)](partial, tile_ends, scales, inv, C, FP8_MAX=fp8_max(qt.dtype),
                                                   AMAX_FLOOR=torch_twin.AMAX_FLOOR, BLOCK_K=8, BLOCK_C=block_c,
                                                   num_warps=LAUNCH["group_columns_warps"], **launch_opts())
    _quantize_tiles_cast_kernel[(tiles * blocks_c,)](x, rs, row_starts, padded_starts, tile_ends, inv, bytes_of(qt)[0],
                                                     N, C, P, G, x.stride(0), x.stride(1), FP8_MAX=fp8_max(qt.dtype),
                                                     **common)


def quantize_group_columns(x: torch.Tensor, row_starts: torch.Tensor, padded_starts: torch.Tensor,
                           padded_rows: int, fp8_dtype: torch.dtype,
                           row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. x [N, C] (any strides), row_starts and padded_starts [E + 1] int on x's device,
    row_scales [N] fp32 contiguous or None -> (qt [C, P] fp8_dtype, scales [E, C] fp32);
    torch_twin.quantize_group_columns states the arithmetic. Reads no device value on the host;
    starts that break the contract give unspecified values, in bounds."""
    N, C = x.shape
    E = row_starts.shape[0] - 1
    qt = torch.empty((C, padded_rows), dtype=fp8_dtype, device=x.device)
    scales = torch.empty((E, C), dtype=torch.float32, device=x.device)
    if E == 0 or C == 0:
        return qt, scales
    if LAUNCH["group_columns_tiles"]:
        _quantize_group_columns_tiled(x, row_starts, padded_starts, qt, scales, row_scales)
        return qt, scales
    block_c, block_r, splits = (LAUNCH[f"group_columns_{k}"] for k in ("block_c", "block_r", "splits"))
    grid = (triton.cdiv(C, block_c), E, splits)
    rs = row_scales if row_scales is not None else scales  # not read without HAS_SCALES
    common = dict(BLOCK_R=block_r, BLOCK_C=block_c, SPLITS=splits, HAS_SCALES=row_scales is not None,
                  X_FP8_MAX=fp8_max(x.dtype), num_warps=LAUNCH["group_columns_warps"], **launch_opts())
    partial = scales  # not read with one slice
    if splits > 1:
        partial = torch.empty((splits, E, C), dtype=torch.float32, device=x.device)
        _group_columns_amax_kernel[grid](x, rs, row_starts, partial, N, C, x.stride(0), x.stride(1), **common)
    _quantize_group_columns_kernel[grid](
        x, rs, row_starts, padded_starts, partial, bytes_of(qt)[0], scales, N, C, padded_rows, x.stride(0),
        x.stride(1), FP8_MAX=fp8_max(fp8_dtype), AMAX_FLOOR=torch_twin.AMAX_FLOOR, **common)
    return qt, scales
