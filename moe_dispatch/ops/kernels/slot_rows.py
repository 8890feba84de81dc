"""What the permutation family's Triton kernels share: the ``slots`` layout, the rules every kernel
keeps, the family's launch settings, the slot-row helpers, and the zeros of the rows no slot points
at. The kernels themselves, each beside its launcher: row_map.py (make_slots), permute.py (permute,
its backward, the row gather), unpermute.py (unpermute and its backward).

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

from .float8 import bytes_of
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



@triton.jit
def _poisoned(status_ptr):
    """True once the device's status records a bad input (guard.py): results become NaN."""
    return tl.max(tl.load(status_ptr + tl.arange(0, 4)), axis=0) != 0


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
uninitialised_buffer = torch.empty  # the buffers the kernels fill whole; tests pass a garbage-filling allocator


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
