"""Row layouts and the autograd pieces shared by both dispatchers.

Why the results are bitwise invariant (rank, dispatcher, EP size, batch):
- every local expert receives its rows in the order (source rank ascending, token ascending), and
  the expert's computation of a row must not depend on the other rows (row-stable);
- expert outputs return UNREDUCED to the token's owner. The owner's buffer is in global
  expert-major order of its own (token, expert) pairs, exactly the order of ``permute`` on its
  full routing map, so the combine is ``unpermute``: one fixed-order fp32 (fp64) sum per token,
  whatever P, the dispatcher or the other tokens;
- the backward of the dispatch is the same path: the gradient of every (token, expert) row goes
  back to the owner unreduced, where ``unpermute(probs=None)`` sums it in fixed order. Nothing is
  ever summed across ranks, and the receiver never sums a token's local copies.

Receiver layout (rows given to the local experts, [N, H]): for each local expert e, for each
source rank s, a block of rows (s's tokens ascending, then capacity padding), then the expert's
tail padding (pad_multiple). Owner layout (rows returned to the owner): for each global expert e,
a block of its tokens ascending (then capacity padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops import RowIdMap, unpermute
from ..ops.permutation import (chunk_gather_index, gather_rows, inverse_permutation, make_slots, permute_rows,
                               shifted_runs)
from .comm import ProcessGroup, all_to_all_rows, all_to_all_rows_autograd
from .layout import Layout


def _host_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Small host ints to the device, non_blocking: a blocking copy synchronises the stream, and
    pinning each tiny table first cost ~100 us of host time on the GPU machine."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def blocked_row_id_map(routing_map: torch.Tensor, counts: list[list[int]], blocks: list[list[int]],
                       tail: list[int], max_per_row: int) -> RowIdMap:
    """RowIdMap for a layout of per-(column, segment) blocks.

    Args:
        routing_map: [R, X] bool; its rows are grouped into S consecutive segments (source ranks).
        counts: [S][X] host ints, routed rows of each (segment, column); must match routing_map.
        blocks: [S][X] host ints >= counts: rows reserved for each (segment, column) block.
        tail: [X] host ints, pad rows after each column's blocks.
        max_per_row: an upper bound on the True entries of a row (sizes unpermute's backward).

    Returns:
        A RowIdMap whose rows are column-major; within a column, segment-major blocks (ascending
        row inside a block, padding at the block's end), then the column's tail padding.
    """
    slots, stats = make_slots(routing_map.contiguous(), 1)  # stats: [X] counts, then max n_t
    col_counts = stats[:-1]
    S, X = len(counts), routing_map.shape[1]
    padded = [sum(blocks[s][x] for s in range(S)) + tail[x] for x in range(X)]
    routed = sum(map(sum, counts))
    num_out = sum(padded)
    if num_out != routed and routed > 0:
        # make_slots numbered the routed rows densely (column-major, ascending row); shift every
        # (column, segment) run of rows to the start of its block.
        sizes, shifts, dense, start = [], [], 0, 0
        for x in range(X):
            for s in range(S):
                sizes.append(counts[s][x])
                shifts.append(start - dense)
                dense += counts[s][x]
                start += blocks[s][x]
            start += tail[x]
        lut = shifted_runs(shifts, sizes, routing_map.device)
        rows = slots[:, 1:1 + X]
        moved = torch.where(rows >= 0, lut[rows.clamp(min=0).long()].to(torch.int32), rows)
        slots = torch.cat([slots[:, :1], moved, slots[:, 1 + X:]], dim=1)
    padded_t = _host_tensor(padded, routing_map.device)
    return RowIdMap(slots, col_counts, padded_t, num_out, num_out > routed, max(1, max_per_row))


def permute_with_map(tokens: torch.Tensor, row_id_map: RowIdMap,
                     probs: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """tokens [R, H], probs [R, X] -> rows [N, H], row probs [N] placed by row_id_map (pad rows 0)."""
    rows, row_probs = permute_rows(tokens, row_id_map.slots, probs, row_id_map.num_out_tokens,
                                     row_id_map.has_pad_rows)
    return rows, (row_probs if probs is not None else None)


def pairs_to_dense(values: torch.Tensor, row_id_map: RowIdMap) -> torch.Tensor:
    """values [N] in row_id_map's row order -> [T, X] with out[t, x] = values[row(t, x)], 0 elsewhere.
    Every (t, x) has at most one row, so this is a pure scatter: no sums."""
    T, X = row_id_map.num_tokens, row_id_map.num_experts
    if values.numel() == 0 or T == 0:
        return values.new_zeros((T, X))
    slots = row_id_map.slots
    rows, cols = slots[:, 1:1 + X].long(), slots[:, 1 + X:].long()
    valid = rows >= 0
    picked = torch.where(valid, values[rows.clamp(min=0)], values.new_zeros(()))
    out = values.new_zeros((T, X + 1))  # column X collects the unused slots (all writing 0)
    out.scatter_(1, torch.where(valid, cols, X), picked)
    return out[:, :X]


def _return_chunks(layout: Layout) -> tuple[list[int], list[int], int]:
    """Chunk sizes of the receiver layout and the order that makes it source-major (pads last)."""
    return layout.memo("return_chunks", lambda: _compute_return_chunks(layout))


def _compute_return_chunks(layout: Layout) -> tuple[list[int], list[int], int]:
    P, El = layout.ep_size, layout.num_local_experts
    blocks, tail = layout.local_blocks(), layout.local_tail_pad()
    sizes = []
    for e in range(El):
        sizes += [blocks[s][e] for s in range(P)] + [tail[e]]
    order = [e * (P + 1) + s for s in range(P) for e in range(El)] + [e * (P + 1) + P for e in range(El)]
    real = sum(sizes) - sum(tail)
    return sizes, order, real


def _source_major_index(layout: Layout, device: torch.device) -> torch.Tensor:
    """[N] int64: row i of the source-major order is row index[i] of the receiver layout. Cached
    on the layout: the combine and the dispatch's backward reorder the same way."""
    def build() -> torch.Tensor:
        sizes, order, _ = _return_chunks(layout)
        return chunk_gather_index(sizes, order, device)
    return layout.memo(("source_major_index", str(device)), build)


def to_source_major(rows: torch.Tensor, layout: Layout,
                    row_probs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Receiver layout [N, H] -> rows grouped by source rank (expert-major inside), pads dropped.
    A pure permutation (autograd: the inverse permutation; dropped pad rows get zero gradient)."""
    sizes, order, real = _return_chunks(layout)
    kept = [i for i in order if sizes[i] > 0]
    if kept != sorted(kept):  # otherwise the rows are already in order
        index = _source_major_index(layout, rows.device)
        if rows.requires_grad and torch.is_grad_enabled():
            inverse = inverse_permutation(index)
        else:
            inverse = index  # only the backward reads it, and there is none
        rows = gather_rows(rows, index, inverse)
        if row_probs is not None:
            row_probs = gather_rows(row_probs[:, None], index, index)[:, 0]
    if real != rows.shape[0]:
        rows = rows[:real]
        row_probs = row_probs[:real] if row_probs is not None else None
    return rows, row_probs


def send_to_owners(rows: torch.Tensor, layout: Layout, group: ProcessGroup, autograd: bool) -> torch.Tensor:
    """Source-major rows [sum send, ...] -> the owner's global expert-major rows [N_owner, ...]."""
    send, recv = layout.return_send_splits(), layout.return_recv_splits()
    if autograd:
        return all_to_all_rows_autograd(rows, recv, send, group)
    return all_to_all_rows(rows, recv, send, group)


@dataclass
class DispatchHandle:
    """What the combine (and the dispatch's backward) needs; returned by ``dispatch``.

    Attributes:
        layout: host-side sizes of this step (identical on every rank).
        group: the EP process group (None: single process).
        kind: 'alltoall' or 'allgather'.
        owner_map: RowIdMap of this rank's own (token, expert) pairs in the returned buffer.
        routing_map: [T, E] bool, this rank's tokens.
        probs: [T, E] fp32/fp64 (the wire dtype), with autograd to the caller's probs.
        probs_in_experts: True: experts apply the probs; the combine sums unweighted.
        hidden_shape: shape of the caller's hidden states ([T, H] or [S, B, H]).
        tokens_per_expert: CPU int64 [El], rows per local expert (padding included).
        permuted_probs: [N] probs of the rows given to the experts (after dispatch).
    """

    layout: Layout
    group: ProcessGroup
    kind: str
    owner_map: RowIdMap
    routing_map: torch.Tensor
    probs: torch.Tensor
    probs_in_experts: bool
    hidden_shape: torch.Size
    tokens_per_expert: Optional[torch.Tensor] = None
    permuted_probs: Optional[torch.Tensor] = None

    def combine_weights(self) -> Optional[torch.Tensor]:
        """[T, E] probs for the combine's weighted sum, or None when the experts applied them."""
        return None if self.probs_in_experts else self.probs


def owner_row_id_map(routing_map: torch.Tensor, layout: Layout) -> RowIdMap:
    """RowIdMap of this rank's (token, expert) pairs in the buffer the experts send back."""
    return blocked_row_id_map(routing_map, [layout.counts[layout.rank]], [layout.owner_blocks()],
                              [0] * layout.num_experts, layout.max_experts_per_token[layout.rank])


def expert_row_id_map(recv_map: torch.Tensor, layout: Layout) -> RowIdMap:
    """RowIdMap of received tokens (grouped by source rank) -> receiver layout for local experts."""
    El, base = layout.num_local_experts, layout.rank * layout.num_local_experts
    counts = [row[base:base + El] for row in layout.counts]
    most = min(El, max(layout.max_experts_per_token))
    return blocked_row_id_map(recv_map, counts, layout.local_blocks(), layout.local_tail_pad(), most)


class _Expand(torch.autograd.Function):
    """Forward: expand the received tokens to one row per (token, local expert).
    Backward: return every row's gradient to its owner unreduced; the owner sums a token's rows
    in ascending expert order in fp32 (``unpermute`` without probs), exactly as at EP size 1.

    Inputs: x [T, H] and probs [T, E] are the owner's tensors that autograd links to; the received
    tensors (detached, from the forward exchange) carry the values.
    """

    @staticmethod
    def forward(ctx, x, probs, recv_x, recv_map, recv_probs, handle):
        expert_map = expert_row_id_map(recv_map, handle.layout)
        rows, row_probs = permute_with_map(recv_x, expert_map, recv_probs)
        # Keep only what the backward needs: holding the handle would make a reference cycle
        # (handle.permuted_probs -> this node -> ctx -> handle).
        ctx.layout, ctx.group, ctx.owner_map = handle.layout, handle.group, handle.owner_map
        ctx.x_shape, ctx.probs_dtype = x.shape, recv_probs.dtype
        # The probs gradient travels back only if some rank needs it (same collectives everywhere).
        ctx.send_probs_grad = handle.probs_in_experts and handle.layout.probs_grad
        if not handle.probs_in_experts:
            ctx.mark_non_differentiable(row_probs)
        return rows, row_probs

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs):
        layout = ctx.layout
        if ctx.send_probs_grad and grad_row_probs is None:
            grad_row_probs = torch.zeros(grad_rows.shape[0], dtype=ctx.probs_dtype, device=grad_rows.device)
        rows, row_probs = to_source_major(grad_rows.contiguous(), layout,
                                          grad_row_probs if ctx.send_probs_grad else None)
        rows = send_to_owners(rows, layout, ctx.group, autograd=False)
        grad_x = unpermute(rows, ctx.owner_map, None).view(ctx.x_shape)
        grad_probs = None
        if ctx.send_probs_grad:
            owner_probs = send_to_owners(row_probs, layout, ctx.group, autograd=False)
            if ctx.needs_input_grad[1]:
                grad_probs = pairs_to_dense(owner_probs, ctx.owner_map)
        return grad_x, grad_probs, None, None, None, None


def expand(x: torch.Tensor, probs: torch.Tensor, recv_x: torch.Tensor, recv_map: torch.Tensor,
           recv_probs: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for the local experts: ([N, H], permuted probs [N]) in the receiver layout."""
    probs_in = probs if handle.probs_in_experts else probs.detach()
    return _Expand.apply(x, probs_in, recv_x, recv_map, recv_probs, handle)
