"""Expert GEMMs: ``out[rows of e] = x[rows of e] @ w[e]`` for every local expert e.

``x`` is [N, K] with rows expert-major (expert 0's rows, then expert 1's, ...), ``w`` is
[E, K, M] and ``tokens_per_expert`` is [E] (int, CPU or device; it must sum to N). Result [N, M].

Strategies, picked by `select_gemm`:

- ``"ordered"`` (CPU, row-stable, every dtype): `moe_dispatch.numerics.fixed_order.ordered_mm` per
  expert, elementwise products summed over K by a fixed pairwise tree, no BLAS call. A row's
  bits are a function of that row and the weights only, by construction, whatever kernels the
  CPU's MKL/oneDNN would pick (their choice changes rows at CPU-model-dependent M, in forward
  and backward alike). Slower than mm; CPU is the test platform.
- ``"grouped"``: one ``torch._grouped_mm`` call, no host sync. Row-stable where
  `grouped_mm_row_stable` says so: CUDA bf16 on sm90+ (a CUTLASS kernel whose rows were the same
  at every M measured, BENCHMARKS.md "Row stability of GEMMs"). On CPU it is the CPU library's
  kernel per group, opt-in only (``row_stable=False``).
- ``"tiled"`` (the CUDA row-stable fallback): the expert's rows in calls of exactly ``row_tile``
  (256) rows, the last tile zero-padded. cuBLAS picks its kernel from the shape and its choice
  changes rows at many M, so padding alone is not enough there; a single fixed shape is. Slow:
  one small GEMM at a time leaves most of the GPU idle (BENCHMARKS.md "Experts").
- ``"loop"``: one plain mm per expert on exactly its rows, as Megatron's SequentialMLP does.
  NOT row-stable (cuBLAS and CPU BLAS change kernels with M). Opt-in only (``row_stable=False``).

Gradients: the input gradient ``dy_row @ w[e]^T`` runs through the same strategy (same tree,
tiling), so it is row-stable whenever the forward is. The weight gradient of expert e is
``x_e^T @ dy_e`` over that expert's rows only ("ordered": a fixed tree over those rows; "tiled"
and "loop": one GEMM; "grouped": a grouped_mm whose groups split the reduction dim):
deterministic, and bitwise equal at any EP size when the expert receives the same rows in the
same order, which tests check on CPU and H200 by building one expert alone and among others.
Empty experts get exact zeros.
"""

from __future__ import annotations

from typing import Callable, List, Literal, Optional, Sequence, Tuple, Union

import torch

from ..numerics.autograd import refuse_double_backward
from ..numerics.fixed_order import ordered_mm

GemmStrategy = Literal["grouped", "ordered", "tiled", "loop"]
# The (local expert, source EP rank) blocks of the rows (``DispatchHandle.source_blocks``): host
# [E][P] (first row, rows) pairs (the dropless plan's), or an int tensor [E, P] on the rows' device,
# each block's rows, the blocks tiling the rows from row 0 on, expert-major and source-minor, and the
# rows after the last block in none (the sync-free plan's: its counts are never read on the host).
SourceBlocks = Union[Sequence[Sequence[Tuple[int, int]]], torch.Tensor]

# Rows per GEMM call of "tiled": larger tiles keep the GPU busier (BENCHMARKS.md "Experts").
DEFAULT_ROW_TILE = 256


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` accepts these operands here (dtype, device, 16-byte strides)."""
    if not hasattr(torch, "_grouped_mm") or x.device != w.device or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        # Only bf16 runs the CUTLASS grouped kernel (sm90+); other dtypes fall back to an mm loop.
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok_dtype = False
    # Operands (and their transposes in backward) need row strides that are multiples of 16 bytes.
    item = x.element_size()
    return ok_dtype and (x.shape[1] * item) % 16 == 0 and (w.shape[2] * item) % 16 == 0


def grouped_mm_row_stable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the row-stable default may use ``torch._grouped_mm`` here: CUDA bf16 only (CUTLASS,
    BENCHMARKS.md "Row stability of GEMMs"; tests/experts/test_gpu.py checks it). Never on CPU:
    there it runs the CPU library's kernel per group, whose choice by M varies with the CPU model.
    """
    return device.type == "cuda" and dtype == torch.bfloat16


def select_gemm(x: torch.Tensor, w: torch.Tensor, prefer_grouped: bool, row_stable: bool) -> GemmStrategy:
    """The strategy `expert_gemm` uses for these operands (see the module docstring)."""
    grouped_ok = prefer_grouped and grouped_mm_supported(x, w)
    if row_stable:
        if grouped_ok and grouped_mm_row_stable(x.device, x.dtype):
            return "grouped"
        return "ordered" if x.device.type == "cpu" else "tiled"
    return "grouped" if grouped_ok else "loop"


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x itself if contiguous and 16-byte aligned, else a fresh copy. Kernels may pick their code
    path from strides and pointer alignment (grouped_mm rejects misaligned operands), so the same
    rows must always arrive in the same layout, whatever view the caller passed."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _counts(tokens_per_expert: torch.Tensor, n_rows: int, trailing_rows: bool = False) -> List[int]:
    """Host counts (a device tensor is read here: a host sync on CUDA, only on these paths)."""
    counts = [int(c) for c in tokens_per_expert.tolist()]
    total = sum(counts)
    if (total > n_rows if trailing_rows else total != n_rows) or min(counts, default=0) < 0:
        raise ValueError(f"tokens_per_expert {counts} must be >= 0 and sum to "
                         f"{'at most ' if trailing_rows else ''}the {n_rows} input rows")
    return counts


def _grouped_dx(grad: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with an explicit backward: the built-in one rejects the stride-0
    gradients that e.g. ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("_GroupedMM")
        x, w, offs = ctx.saved_tensors
        if grad.shape[0] == 0:  # no rows: an empty tensor may carry strides grouped_mm rejects
            return torch.zeros_like(x), torch.zeros_like(w), None
        grad = _dense(grad)
        # dx rows: dy_row @ w[e]^T, one grouped GEMM again (row-stable like the forward).
        gx = _grouped_dx(grad, w, offs) if ctx.needs_input_grad[0] else None
        # dw[e] = x_e^T @ dy_e: groups now split the reduction dim; empty groups give zeros.
        gw = torch._grouped_mm(x.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _grouped(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor,
             offsets: Optional[torch.Tensor], trailing_rows: bool = False,
             per_source: Optional[tuple] = None) -> torch.Tensor:
    if tokens_per_expert.device.type == "cpu":
        _counts(tokens_per_expert, x.shape[0], trailing_rows)  # cheap check; a device tensor would need a sync
    if offsets is None:
        # A CPU tensor here is a pageable host-to-device copy per call: pass offsets to avoid it.
        offsets = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
    elif offsets.shape != (w.shape[0],) or offsets.dtype != torch.int32 or offsets.device != x.device:
        raise ValueError(f"offsets must be int32 [{w.shape[0]}] on {x.device}, got {offsets.dtype} "
                         f"{list(offsets.shape)} on {offsets.device}")
    if per_source is not None:
        return _PerSourceMM.apply(x, w, offsets, None, None, *per_source)
    return _GroupedMM.apply(x, w, offsets)


def _blockwise(x: torch.Tensor, w: torch.Tensor, counts: List[int], row_tile: int) -> torch.Tensor:
    """x [N, K] @ w[e] [K, M] per expert block: calls of exactly ``row_tile`` rows, or (0) one
    call on exactly the expert's rows; rows after sum(counts) (trailing rows of no expert) give zeros."""
    out = x.new_empty(x.shape[0], w.shape[2])
    out[sum(counts):].zero_()
    start = 0
    for e, m in enumerate(counts):
        # Full tiles are read in place; only the ragged tail is copied and zero-padded.
        full = m - m % row_tile if row_tile else 0
        for s in range(start, start + full, row_tile or 1):
            out[s : s + row_tile] = x[s : s + row_tile] @ w[e]
        rest = m - full
        if rest:
            block = x[start + full : start + m]
            pad = -rest % row_tile if row_tile else 0
            if pad:
                block = torch.cat([block, block.new_zeros(pad, block.shape[1])])
            out[start + full : start + m] = (block @ w[e])[:rest]
        start += m
    return out


def _ordered(x: torch.Tensor, w: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """x [N, K] @ w[e] [K, M] per expert block by `ordered_mm` (no BLAS); trailing rows give zeros."""
    out = x.new_empty(x.shape[0], w.shape[2])
    n = sum(counts)
    out[n:].zero_()
    for e, (rows, xe) in enumerate(zip(torch.split(out[:n], counts), torch.split(x[:n], counts))):
        rows.copy_(ordered_mm(xe, w[e]))
    return out


def _loop_forward(x: torch.Tensor, w: torch.Tensor, counts: List[int], row_tile: Optional[int]) -> torch.Tensor:
    """"ordered" (row_tile None) or "tiled"/"loop" (row_tile a number): x [N, K] @ w[e] per expert block."""
    return _ordered(x, w, counts) if row_tile is None else _blockwise(x, w, counts, row_tile)


class _LoopMM(torch.autograd.Function):
    """Per-expert GEMMs (``"ordered"``, ``"tiled"`` or ``"loop"``) with an explicit backward:
    dx through the same blocking as the forward, dw one product per expert over its rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: List[int], row_tile: Optional[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.args = (counts, row_tile)
        return _loop_forward(x, w, counts, row_tile)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("_LoopMM")
        x, w = ctx.saved_tensors
        counts, row_tile = ctx.args
        grad = _dense(grad)
        gx = _loop_forward(grad, w.transpose(1, 2), counts, row_tile) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = torch.empty_like(w)
            mm = ordered_mm if row_tile is None else torch.mm
            n = sum(counts)  # trailing rows (no expert) add nothing
            for e, (xe, ge) in enumerate(zip(torch.split(x[:n], counts), torch.split(grad[:n], counts))):
                gw[e] = mm(xe.t(), ge)  # K = that expert's row count; an empty expert gives zeros
        return gx, gw, None, None


class _PerSourceMM(torch.autograd.Function):
    """An expert GEMM whose weight gradient is one product per (local expert, source) block, handed
    to ``sink`` as [E, P, K, M] instead of to autograd (``w`` gets none). The forward and the input
    gradient are the strategy's own calls ("grouped" when ``offs`` is given, else the loop paths)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: Optional[torch.Tensor], counts: Optional[List[int]],  # type: ignore[override]
                row_tile: Optional[int], blocks: SourceBlocks, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.args = (counts, row_tile, blocks, sink)
        return torch._grouped_mm(x, w, offs=offs) if offs is not None else _loop_forward(x, w, counts, row_tile)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("_PerSourceMM")
        x, w, offs = ctx.saved_tensors
        counts, row_tile, blocks, sink = ctx.args
        if offs is not None and grad.shape[0] == 0:
            gx = torch.zeros_like(x)
        else:
            grad = _dense(grad)
            gx = None
            if ctx.needs_input_grad[0]:
                gx = _grouped_dx(grad, w, offs) if offs is not None else \
                    _loop_forward(grad, w.transpose(1, 2), counts, row_tile)
        if ctx.needs_input_grad[1]:
            sink(source_weight_grads(x, grad, blocks, w.shape, "grouped" if offs is not None else row_tile))
        return gx, None, None, None, None, None, None


def source_weight_grads(x: torch.Tensor, grad: torch.Tensor, blocks: SourceBlocks, w_shape: torch.Size,
                        how: "str | int | None") -> torch.Tensor:
    """x [N, K], grad [N, M] -> [E, P, K, M]: ``x_b^T @ grad_b`` for each (expert e, source s) block
    b = blocks[e][s]; rows in no block (padding after an expert's blocks, a sync-free buffer's
    trailing rows) add nothing. ``how``: "grouped" (one torch._grouped_mm, a group per block: each
    group's result is its rows' alone), None (`ordered_mm` per block) or a row tile (torch.mm per
    block, the loop paths). Expert-major like the rows, so the grouped result is the output itself
    when no padding rows need a group. Device ``blocks`` (the sync-free plan's): "grouped" takes
    their cumulative ends on the device (no host read); the other paths read them (on CUDA a host
    sync, as those paths' counts are)."""
    E, K, M = w_shape
    if isinstance(blocks, torch.Tensor):
        if how == "grouped" and x.shape[0] > 0:
            P = blocks.shape[1]
            # the blocks tile the rows from row 0: their ends are the groups' (the trailing rows in none)
            offs = torch.cumsum(blocks.reshape(-1).to(torch.int64), 0).to(torch.int32)
            return torch._grouped_mm(x.t(), grad, offs=offs).view(E, P, K, M)
        blocks = host_source_blocks(blocks)
    P = len(blocks[0]) if E else 0
    if how != "grouped" or x.shape[0] == 0:
        out = x.new_zeros(E, P, K, M)
        mm = ordered_mm if how is None else torch.mm
        for e in range(E):
            for s, (first, rows) in enumerate(blocks[e]):
                if rows:
                    out[e, s] = mm(x[first:first + rows].t(), grad[first:first + rows])
        return out
    ends, pick = [], []
    cursor = 0
    for e in range(E):
        for first, rows in blocks[e]:
            if first > cursor:  # padding rows before this block: a group of their own, dropped
                ends.append(first)
            pick.append(len(ends))
            ends.append(first + rows)
            cursor = first + rows
    if cursor < x.shape[0]:
        ends.append(x.shape[0])
    offs = torch.tensor(ends, dtype=torch.int32).to(x.device)
    groups = torch._grouped_mm(x.t(), grad, offs=offs)  # [G, K, M]; empty groups give zeros
    if len(ends) == E * P:
        return groups.view(E, P, K, M)
    index = torch.tensor(pick, dtype=torch.int64).to(x.device)
    return groups.index_select(0, index).view(E, P, K, M)


def host_source_blocks(blocks: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """Device blocks (int [E, P], each block's rows, tiling the rows from row 0) as host [E][P]
    (first row, rows) pairs: a host read (on CUDA a synchronisation)."""
    out, cursor = [], 0
    for row in blocks.tolist():
        out.append([])
        for rows in row:
            out[-1].append((cursor, int(rows)))
            cursor += int(rows)
    return out


def _check_blocks(blocks: SourceBlocks, tokens_per_expert: torch.Tensor, num_experts: int,
                  x: Optional[torch.Tensor] = None) -> SourceBlocks:
    """ValueError unless ``blocks`` is [E][P] of (first row, rows) tiling each expert's rows from its
    first row on, in order (host counts only; device counts are not read); device blocks: an
    integer tensor [E, P] on x's device (its values are not read)."""
    if isinstance(blocks, torch.Tensor):
        device = x.device if x is not None else blocks.device
        if blocks.dim() != 2 or blocks.shape[0] != num_experts or blocks.shape[1] == 0 or \
                blocks.is_floating_point() or blocks.device != device:
            raise ValueError(f"source_blocks as a tensor must be integer [{num_experts}, P] (rows of each block) on "
                             f"{device}, got {blocks.dtype} {list(blocks.shape)} on {blocks.device}")
        return blocks
    widths = {len(row) for row in blocks}
    if len(blocks) != num_experts or len(widths) != 1 or 0 in widths:
        raise ValueError(f"source_blocks must be [{num_experts}][P] (first row, rows) pairs, got "
                         f"{[len(row) for row in blocks]} per expert")
    counts = tokens_per_expert.tolist() if tokens_per_expert.device.type == "cpu" else None
    start = 0
    for e, row in enumerate(blocks):
        cursor = row[0][0]
        if counts is not None and cursor != start:
            raise ValueError(f"source_blocks: expert {e}'s first block starts at row {cursor}, its rows at {start}")
        for first, rows in row:
            if first != cursor or rows < 0:
                raise ValueError(f"source_blocks: expert {e}'s blocks {list(row)} are not consecutive row ranges")
            cursor = first + rows
        if counts is not None:
            if cursor > start + counts[e]:
                raise ValueError(f"source_blocks: expert {e}'s blocks end at row {cursor}, past its "
                                 f"{counts[e]} rows from row {start}")
            start += counts[e]
    return blocks


def expert_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    strategy: GemmStrategy,
    row_tile: int = 0,
    offsets: Optional[torch.Tensor] = None,
    trailing_rows: bool = False,
    source_blocks: Optional[SourceBlocks] = None,
    sink: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """``x`` [N, K] expert-major, ``w`` [E, K, M], ``tokens_per_expert`` [E] -> [N, M].

    ``trailing_rows``: tokens_per_expert may sum to less than N (a sync-free dispatch's buffer);
    the rows after the last expert's block belong to no expert: zeros on the loop paths,
    unspecified on "grouped" (nothing of ours reads them). tokens_per_expert may then be a device
    tensor: "grouped" never reads it; the loop paths read it (a host sync on CUDA).

    ``row_tile`` (``"tiled"`` only): rows per GEMM call, 0 means ``DEFAULT_ROW_TILE``.
    ``offsets``: optional int32 [E] on x's device, the cumulative sum of tokens_per_expert (what
    ``"grouped"`` needs; the dispatcher's ``handle.expert_offsets``): saves a host-to-device copy.
    ``source_blocks`` (``SourceBlocks``: host [E][P] (first row, rows), or device [E, P] rows with
    ``trailing_rows``, see `source_weight_grads`) with ``sink``: the weight gradient is computed per
    (expert, source) block and passed to ``sink`` as [E, P, K, M] (w itself gets no gradient); the
    forward and the input gradient are unchanged.
    """
    x = _dense(x)
    per_source = None
    if source_blocks is not None:
        if sink is None:
            raise ValueError("source_blocks needs a sink (where the per-source weight gradients go)")
        per_source = (_check_blocks(source_blocks, tokens_per_expert, w.shape[0], x), sink)
    if strategy == "grouped":
        return _grouped(x, w, tokens_per_expert, offsets, trailing_rows, per_source)
    tiles = {"ordered": None, "loop": 0, "tiled": row_tile or DEFAULT_ROW_TILE}
    if strategy not in tiles:
        raise ValueError(f"unknown GEMM strategy {strategy!r}, expected one of grouped, {', '.join(tiles)}")
    counts = _counts(tokens_per_expert, x.shape[0], trailing_rows)
    if per_source is not None:
        return _PerSourceMM.apply(x, w, None, counts, tiles[strategy], *per_source)
    return _LoopMM.apply(x, w, counts, tiles[strategy])
