"""Triton kernels of the permutation family, each beside its launcher: the row-id map
(make_slots), permute, unpermute and their backwards, the row gather, and the zeros of the rows
no slot points at.

Every launcher here has a pure-torch twin of the same name in ``torch_twin.py`` that states what
it computes; on CPU the twin runs, on CUDA these kernels run, and under ``TRITON_INTERPRET=1`` the tests check
that the two agree bitwise in fp32.

Layout of the ``slots`` tensor that all kernels share (int32, ``[T, 2E + 1]``):
    slots[t, 0]            n_t, the number of experts token t is routed to
    slots[t, 1 + j]        permuted row of token t's j-th expert, j < n_t, experts ascending
    slots[t, 1 + E + j]    expert id of that slot
    unused slots hold -1.

Rules that make results exact and reproducible:
- no atomics; every output element is written by exactly one program;
- sums over a token's experts run in slot order (ascending expert id) in an fp32 (fp64 for fp64
  probabilities) accumulator and are rounded once;
- launches pass ``enable_fp_fusion=False`` so ``acc + p * y`` is a multiply then an add, exactly
  as the torch twin computes it, rather than an FMA;
- float8 rows are copied as bytes (permute) or widened to fp32 (the sums); a float8 result is
  saturated to the format's largest finite value, then rounded to nearest even (``round_out``),
  as torch_twin.round_to does.

Rules that keep every access in bounds whatever the input (host sizes, hand-made slots):
- every row read or written is masked against the rows of its tensor ([0, N)), every expert id
  against [0, E), n_t clamped to [0, E], partial sums against the backward's bound; offsets int64;
- the kernels read the device's status words (guard.py) and write NaN once a bad input was seen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import guard
from ..torch_twin import NUMERICS, block_h, fp8_max, max_slots_bound
from .float8 import bytes_of, round_out
from .launch import LAUNCH, launch_opts

# Launch settings. None of these changes a result: each program owns whole (token, H-chunk)
# elements, and sums run in slot order whatever the grouping. BENCHMARKS.md, "Launch defaults",
# names the measurement (and its command) behind each default; scripts/tune_ops.py sweeps them.
# "token_major": consecutive programs take consecutive tokens of one H-chunk (True) or the
# H-chunks of one token (False: whole rows stream together). "warps" overrides the warp count.
# "rows_per_store": rows the permute kernel writes per 2-D store (1 = one row at a time).
# "permute_store_cache": the PTX cache hint of the permute kernel's row stores ("" = write-back,
# ".cs" = streaming; the permute kernel only writes what it copies, so it has no use for the
# rows in cache). "map_chunks", "map_block_t", "map_warps": make_slots' token chunks (about that
# many programs), tokens per tile (None: 4096 / E rounded to a power of two, at most 128) and
# warps (None: Triton's default).
# "slots_per_step" (unpermute, permute's backward) and "unpermute_bwd_slots_per_step" (the
# unpermute backward, both routes): slots per unrolled step of the kernel's loop over a token's
# slots. A step's row loads are issued together; the sums still run slot by slot in slot order (a
# slot past n_t leaves them as they are), so no value changes.
# "probs_grad_warps": warps of the probs gradient's last kernel (_probs_grad_kernel: a few sums
# per token, so few warps each let more tokens' programs run at once).
# "unpermute_bwd_per_token": the unpermute backward's other route (same kernel, same bits): one
# program per token walking its H-chunks, instead of one per (token, H-chunk) plus the
# probs-gradient launch.
LAUNCH.update({"token_major": False, "warps": None, "rows_per_store": 8, "permute_store_cache": ".cs",
               "map_chunks": 128, "map_block_t": None, "map_warps": None, "slots_per_step": 4,
               "unpermute_bwd_slots_per_step": 2, "probs_grad_warps": 1, "unpermute_bwd_per_token": False})


def _num_warps(block: int) -> int:
    if LAUNCH["warps"]:
        return LAUNCH["warps"]
    return 4 if block <= 1024 else 8


def _row_grid(T: int, H: int, block: int) -> tuple:
    """1-D grid over (token, H-chunk) programs (no 65535 limit on T; at most 2^31 - 1 programs)."""
    programs = T * triton.cdiv(H, block)
    if programs >= 2 ** 31:
        raise ValueError(f"{T} rows of H = {H} need {programs} programs of {block} columns, more than one launch "
                         f"takes (2^31 - 1): split the batch")
    return (programs,)


@triton.jit
def _token_and_chunk(T, H, BLOCK_H: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """(t int64, H-chunk c) of this program on the 1-D grid of `_row_grid`."""
    pid = tl.program_id(0).to(tl.int64)
    if TOKEN_MAJOR:
        t = pid % T
        c = (pid // T).to(tl.int32)
    else:
        n_chunks = tl.cdiv(H, BLOCK_H)
        t = pid // n_chunks
        c = (pid % n_chunks).to(tl.int32)
    return t, c


@triton.jit
def _token_slots(slots_ptr, T, H, E, BLOCK_H: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """The prologue of the slot-driven kernels: (t, c, this chunk's columns offs_h and mask_h,
    the token's slot row pointer, n_t)."""
    t, c = _token_and_chunk(T, H, BLOCK_H, TOKEN_MAJOR)
    offs_h = c * BLOCK_H + tl.arange(0, BLOCK_H)
    slot_row = slots_ptr + t * (2 * E + 1)
    # n_t clamped to [0, E]: a hand-made slots tensor can never send a loop past its row.
    return t, c, offs_h, offs_h < H, slot_row, tl.minimum(tl.maximum(tl.load(slot_row), 0), E)


@triton.jit
def _slot(slot_row, j, n):
    """(live, row) of a token's slot j in the summing kernels' unrolled steps: live is j < n_t, and
    the row (int64) is -1 past n_t, so every access through it is masked (_row_in)."""
    live = j < n
    return live, tl.load(slot_row + 1 + j, mask=live, other=-1).to(tl.int64)


@triton.jit
def _row_in(row, N, H):
    """The columns of a row to touch: H for a row in [0, N), else 0 (masks every load and store of
    a row outside the allocation, e.g. after host-supplied sizes that were too small)."""
    return tl.where((row >= 0) & (row < N), H, 0)


@triton.jit
def _load_slot_row(rows_ptr, slot_row, j, n, N, H, offs_h, stride_n, stride_h):
    """(live, row, y) of a token's slot j in the summing kernels: _slot's (live, row) and the row's
    chunk y [BLOCK_H] widened to fp32, zero for a dead slot or a row outside [0, N)."""
    live, row = _slot(slot_row, j, n)
    y = tl.load(rows_ptr + row * stride_n + offs_h * stride_h, mask=offs_h < _row_in(row, N, H),
                other=0.0).to(tl.float32)
    return live, row, y



def _probs_args(probs: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, stride_t, stride_e) for a kernel's optional probs; a placeholder when absent."""
    if probs is None:
        return placeholder, 0, 0
    return probs, probs.stride(0), probs.stride(1)


# --------------------------------------------------------------------------------------------
# Zeros for the rows no slot points at (padding, trailing rows of a sync-free plan's buffer).
# The permute and the unpermute backward write every row a slot points at, whole; a buffer they
# must return zero-filled gets zeros only in the other rows, rather than a fill of all N rows
# first (at EP 1 no row is left over, and the fill was a write of the whole buffer).
# --------------------------------------------------------------------------------------------
# "zero_only_uncovered": True (the default: 0.16-0.24 ms faster a layer step, BENCHMARKS.md, FP8)
# writes zeros only in the uncovered rows; False fills the whole buffer with zeros first. Either
# way the same bits.
LAUNCH.update({"zero_only_uncovered": True, "cover_block_t": 64, "cover_block_j": 8, "uncovered_block_r": 64,
               "uncovered_block_w": 256})
_uninitialised = torch.empty  # the buffers these kernels fill whole; tests pass a garbage-filling allocator


@triton.jit
def _cover_rows_kernel(slots_ptr, covered_ptr, T, E, N, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr):
    """covered[row] = 1 for every row of tokens [pid * BLOCK_T, + BLOCK_T)'s slots j < n_t (n_t
    clamped to [0, E], as the permute and unpermute kernels clamp it) with row in [0, N): the rows
    those kernels write. Rows two slots share get the same 1."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    slot_rows = slots_ptr + offs_t * (2 * E + 1)
    n = tl.minimum(tl.maximum(tl.load(slot_rows, mask=mask_t, other=0), 0), E)
    offs_j = tl.arange(0, BLOCK_J)
    for j0 in range(0, tl.max(n, axis=0), BLOCK_J):
        live = mask_t[:, None] & ((j0 + offs_j)[None, :] < n[:, None])
        row = tl.load(slot_rows[:, None] + 1 + j0 + offs_j[None, :], mask=live, other=-1).to(tl.int64)
        ok = live & (row >= 0) & (row < N)
        tl.store(covered_ptr + row, tl.full([BLOCK_T, BLOCK_J], 1, tl.int8), mask=ok)


@triton.jit
def _zero_uncovered_rows_kernel(out_ptr, covered_ptr, N, W, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[row, :W] = 0 for rows [pid * BLOCK_R, + BLOCK_R) of [0, N) with covered[row] == 0;
    out [N, W] contiguous. A block with no such row stores nothing."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    gap = (offs_r < N) & (tl.load(covered_ptr + offs_r, mask=offs_r < N, other=1) == 0)
    width = tl.where(tl.max(gap.to(tl.int32), axis=0) > 0, W, 0)
    zeros = tl.zeros([BLOCK_R, BLOCK_W], dtype=out_ptr.dtype.element_ty)
    for w0 in range(0, width, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        tl.store(out_ptr + offs_r[:, None] * W + offs_w[None, :], zeros, mask=gap[:, None] & (offs_w < W)[None, :])


def zero_uncovered_rows(out: torch.Tensor, slots: torch.Tensor) -> None:
    """Launcher. out [N, W] contiguous, slots [T, 2E + 1]: zeros (all bits clear) in every row of
    out that no slot j < n_t points at, in place; the other rows are left as they are."""
    N, W = out.shape
    if N == 0 or W == 0:
        return
    if not LAUNCH["zero_only_uncovered"]:
        bytes_of(out)[0].zero_()
        return
    T = slots.shape[0]
    E = (slots.shape[1] - 1) // 2
    covered = torch.zeros(N, dtype=torch.int8, device=out.device)
    if T > 0:
        block_t = LAUNCH["cover_block_t"]
        _cover_rows_kernel[(triton.cdiv(T, block_t),)](slots, covered, T, E, N, BLOCK_T=block_t,
                                                        BLOCK_J=LAUNCH["cover_block_j"], **launch_opts())
    block_r = LAUNCH["uncovered_block_r"]
    data, _ = bytes_of(out)
    _zero_uncovered_rows_kernel[(triton.cdiv(N, block_r),)](
        data, covered, N, W, BLOCK_R=block_r, BLOCK_W=min(LAUNCH["uncovered_block_w"], triton.next_power_of_2(W)),
        **launch_opts())


# --------------------------------------------------------------------------------------------
# Row-id map: per-chunk expert counts, then slot lists. Two launches, no torch ops between.
# --------------------------------------------------------------------------------------------
@triton.jit
def _expert_weights(offs_e):
    """guard.expert_weight for a vector of expert ids (int64, wrapping; arithmetic shifts)."""
    w = (offs_e.to(tl.int64) + 1) * 0x1E3779B97F4A7C15
    w = w ^ (w >> 29)
    w = w * 0x3F58476D1CE4E5B9
    return w ^ (w >> 32)


@triton.jit
def _poisoned(status_ptr):
    """True once the device's status records a bad input (guard.py): results become NaN."""
    return tl.max(tl.load(status_ptr + tl.arange(0, 4)), axis=0) != 0


@triton.jit
def _chunk_counts_kernel(
    map_ptr, counts_ptr, chunk_max_ptr, probs_ptr, status_ptr, T, E, stride_mt, stride_me, stride_pt, stride_pe,
    CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHECK_PROBS: tl.constexpr,
    PROBS_WORD: tl.constexpr,
):
    """counts[c, e] = number of tokens of chunk c (rows c*CHUNK_T ...) routed to expert e;
    chunk_max[c] = the most experts any token of chunk c is routed to. With CHECK_PROBS, a NaN or
    inf anywhere in the chunk's probs rows sets the status word PROBS_WORD (a plain store of 1)."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    most = tl.zeros([BLOCK_T], dtype=tl.int32)
    nonfinite = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        offs_t = pid * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        mask = (offs_t[:, None] < T) & (offs_e[None, :] < E)
        routed = tl.load(map_ptr + offs_t[:, None].to(tl.int64) * stride_mt + offs_e[None, :] * stride_me,
                         mask=mask, other=0).to(tl.int32)
        total += tl.sum(routed, axis=0)
        most = tl.maximum(most, tl.sum(routed, axis=1))
        if CHECK_PROBS:
            p = tl.load(probs_ptr + offs_t[:, None].to(tl.int64) * stride_pt + offs_e[None, :] * stride_pe,
                        mask=mask, other=0.0)
            nonfinite += tl.sum(tl.where(tl.abs(p) < float("inf"), 0, 1), axis=0)
    tl.store(counts_ptr + pid * E + offs_e, total, mask=offs_e < E)
    tl.store(chunk_max_ptr + pid, tl.max(most, axis=0))
    if CHECK_PROBS:
        flag = tl.arange(0, 1)
        tl.store(status_ptr + PROBS_WORD + flag, flag + 1, mask=(flag + tl.max(nonfinite, axis=0)) > 0)


@triton.jit(do_not_specialize=["given_routed", "given_hash", "given_max"])
def _slots_kernel(
    map_ptr, counts_ptr, chunk_max_ptr, slots_ptr, stats_ptr, status_ptr, T, E, num_chunks, pad_multiple,
    stride_mt, stride_me, given_routed, given_hash, given_max,
    CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    SNAPSHOT: tl.constexpr, CHECK_SIZES: tl.constexpr, SIZES_WORD: tl.constexpr,
):
    """Fill slots for the tokens of one chunk.

    Every program re-reads the small [num_chunks, E] count table to get its own prefix and the
    expert totals, so the scan needs no extra launch. The row of (t, e) is
    expert_start[e] + (tokens before t routed to e). Program 0 writes stats: the [E] totals, the
    most experts of a token, and with SNAPSHOT the device's status words after this call's own
    check (CHECK_SIZES: the routed total and the most experts of a token against the caller's,
    exactly, and the split through guard.counts_hash).
    """
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    valid_e = offs_e < E
    prefix = tl.zeros([BLOCK_E], dtype=tl.int32)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        counts = tl.load(counts_ptr + offs_c[:, None] * E + offs_e[None, :],
                         mask=(offs_c[:, None] < num_chunks) & valid_e[None, :], other=0)
        total += tl.sum(counts, axis=0)
        prefix += tl.sum(tl.where(offs_c[:, None] < pid, counts, 0), axis=0)
    padded = ((total + pad_multiple - 1) // pad_multiple * pad_multiple).to(tl.int64)
    # int64: the rows of all experts together may pass 2^31 (the host then refuses the sizes, and
    # the kernels drop every row outside the output).
    running = tl.cumsum(padded, axis=0) - padded + prefix
    if pid == 0:
        tl.store(stats_ptr + offs_e, total.to(tl.int64), mask=valid_e)
        most = tl.zeros([BLOCK_C], dtype=tl.int32)
        for c0 in range(0, num_chunks, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            most = tl.maximum(most, tl.load(chunk_max_ptr + offs_c, mask=offs_c < num_chunks, other=0))
        most_of_all = tl.max(most, axis=0)
        tl.store(stats_ptr + E, most_of_all.to(tl.int64))
        if SNAPSHOT:
            offs_s = tl.arange(0, 4)
            words = tl.load(status_ptr + offs_s)
            if CHECK_SIZES:
                wide = tl.where(valid_e, total.to(tl.int64), 0)
                bad = ((tl.sum(wide, axis=0) != given_routed) | (most_of_all > given_max)
                       | (tl.sum(wide * _expert_weights(offs_e), axis=0) != given_hash))
                words = tl.where(offs_s == SIZES_WORD, tl.where(bad, 1, words), words)
                tl.store(status_ptr + offs_s, words)
            tl.store(stats_ptr + E + 1 + offs_s, words.to(tl.int64))
    width = 2 * E + 1
    for t0 in range(0, CHUNK_T, BLOCK_T):
        offs_t = pid * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        valid_t = offs_t < T
        mask = valid_t[:, None] & valid_e[None, :]
        routed = tl.load(map_ptr + offs_t[:, None].to(tl.int64) * stride_mt + offs_e[None, :] * stride_me,
                         mask=mask, other=0).to(tl.int32)
        rows = running[None, :] + tl.cumsum(routed, axis=0) - routed
        running += tl.sum(routed, axis=0)
        slot = tl.cumsum(routed, axis=1) - 1
        base = slots_ptr + offs_t[:, None].to(tl.int64) * width
        tl.store(slots_ptr + offs_t.to(tl.int64) * width, tl.sum(routed, axis=1), mask=valid_t)
        minus_one = tl.full([BLOCK_T, BLOCK_E], -1, tl.int32)
        tl.store(base + 1 + offs_e[None, :], minus_one, mask=mask)
        tl.store(base + 1 + E + offs_e[None, :], minus_one, mask=mask)
        # The -1 fill and the scatter below touch the same addresses from different threads.
        tl.debug_barrier()
        hit = mask & (routed != 0)
        tl.store(base + 1 + slot, rows.to(tl.int32), mask=hit)
        tl.store(base + 1 + E + slot, offs_e[None, :] + tl.zeros([BLOCK_T, BLOCK_E], tl.int32), mask=hit)


def _make_slots(routing_map: torch.Tensor, pad_multiple: int, probs: torch.Tensor | None,
                given_counts: list[int] | None, given_max: int | None,
                snapshot: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = routing_map.shape
    device = routing_map.device
    slots = torch.empty((T, 2 * E + 1), dtype=torch.int32, device=device)
    status = guard.status(device)
    stats_len = E + 1 + (guard.STATUS_WORDS if snapshot else 0)
    if T == 0:
        stats = torch.zeros(stats_len, dtype=torch.int64, device=device)
        if snapshot:
            stats[E + 1:] = status
        return slots, stats
    block_e = triton.next_power_of_2(E)
    block_t = LAUNCH["map_block_t"] or max(1, min(128, 4096 // block_e))
    # About 128 chunks: enough programs to fill the GPU, a count table small enough to re-read.
    chunk_t = block_t * triton.cdiv(triton.cdiv(T, LAUNCH["map_chunks"]), block_t)
    num_chunks = triton.cdiv(T, chunk_t)
    routed = routing_map.view(torch.uint8)
    counts = torch.empty((num_chunks, E), dtype=torch.int32, device=device)
    chunk_max = torch.empty(num_chunks, dtype=torch.int32, device=device)
    stats = torch.empty(stats_len, dtype=torch.int64, device=device)
    warps = {"num_warps": LAUNCH["map_warps"]} if LAUNCH["map_warps"] else {}
    p, *p_strides = _probs_args(probs, counts)
    _chunk_counts_kernel[(num_chunks,)](routed, counts, chunk_max, p, status, T, E, routed.stride(0),
                                        routed.stride(1), *p_strides, CHUNK_T=chunk_t, BLOCK_T=block_t,
                                        BLOCK_E=block_e, CHECK_PROBS=probs is not None,
                                        PROBS_WORD=guard.PROBS_PERMUTE, **warps)
    check = given_counts is not None
    given = ((sum(given_counts), guard.counts_hash(given_counts), E if given_max is None else given_max)
             if check else (0, 0, 0))
    _slots_kernel[(num_chunks,)](routed, counts, chunk_max, slots, stats, status, T, E, num_chunks, pad_multiple,
                                 routed.stride(0), routed.stride(1), *given,
                                 CHUNK_T=chunk_t, BLOCK_T=block_t, BLOCK_E=block_e,
                                 BLOCK_C=max(1, min(32, 8192 // block_e)), SNAPSHOT=snapshot, CHECK_SIZES=check,
                                 SIZES_WORD=guard.SIZES, **warps)
    return slots, stats


def make_slots(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher. routing_map [T, E] bool -> (slots [T, 2E+1] int32, stats int64 [E + 1]):
    stats[:E] = tokens per expert, stats[E] = the most experts of any token (one host copy)."""
    return _make_slots(routing_map, pad_multiple, None, None, None, snapshot=False)


def make_slots_checked(routing_map: torch.Tensor, pad_multiple: int, probs: torch.Tensor | None,
                       given_counts: list[int] | None,
                       given_max: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_slots with permute's device-side checks (guard.py): probs [T, E] finite, and the
    caller's tokens_per_expert / max_experts_per_token (when given) against the routing map.
    Returns (slots, stats int64 [E + 1 + STATUS_WORDS]: make_slots' stats, then the status words).
    On CPU it raises at once; on CUDA the caller checks stats: at its synchronisation, or through
    guard.queue once its own kernels are queued."""
    E = routing_map.shape[1]
    slots, stats = _make_slots(routing_map, pad_multiple, probs, given_counts, given_max, snapshot=True)
    if stats.device.type == "cpu":
        guard.check_snapshot(stats.tolist(), E, given_counts, given_max)
    return slots, stats


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
    out = _uninitialised((num_out, H), dtype=tokens.dtype, device=tokens.device)
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
    grad_rows = _uninitialised((N, H), dtype=rows.dtype, device=rows.device)
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
