"""The row-id map of the permutation family (``slots``, layout in slot_rows.py): per-chunk expert
counts, then each token's slot list, in two launches with no torch op between; its launchers
make_slots and make_slots_checked. The rules every kernel keeps: slot_rows.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import guard
from .launch import LAUNCH
from .slot_rows import (
    _probs_args,
)


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
