"""The routing-map ops behind ``moe_dispatch.ops.te``: TransformerEngine's map formats to our slots.

Our kernels (custom_ops.permute_rows / unpermute_rows) take ``slots``, int32 [T, 2X + 1]: per
token its count n_t, its permuted rows (ascending) and, beside each row, the column of ``probs``
that weights it; -1 beyond n_t. These ops build slots from TE's two map formats:

- a mask map (``routing_map`` [T, E], bool or 0/1): X = E, the columns are expert ids;
- an index map (``indices`` [T, K] of expert ids): X = K, the columns are top-k positions, so
  ``probs`` is TE's [T, K] merging-probs tensor as it is.

Rows are expert-major, ascending token (and ascending k) within an expert: the order of a stable
sort of the expert ids, which is TE's order and the PyTorch reference's. Dropping
(``num_out_tokens`` below the routed rows) keeps the first ``num_out_tokens`` rows of that order;
a token's kept rows are then a prefix of its slots, since its rows rise with its expert.

The two ops that check values of device tensors (``te_mask_slots``, ``chunk_sort_index``) are
registered with torch.library, so torch.compile keeps them whole: on CUDA each reads its
check's result on the host once (a synchronisation), and raises ValueError naming the argument.
"""
from __future__ import annotations

import torch

from . import custom_ops

INT32_MAX = 2 ** 31 - 1


def drop_rows(slots: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """slots [T, 2X + 1] without the rows >= num_out_tokens (n_t lowered, entries set to -1).
    A token's slots list its rows ascending, so the rows kept are a prefix."""
    X = (slots.shape[1] - 1) // 2
    n = slots[:, :1].to(torch.int64)
    rows = slots[:, 1 : X + 1]
    live = (torch.arange(X, device=slots.device)[None, :] < n) & (rows >= 0) & (rows < num_out_tokens)
    out = torch.full_like(slots, -1)
    out[:, 0] = live.sum(1).to(torch.int32)
    out[:, 1 : X + 1] = torch.where(live, rows, -1)
    out[:, X + 1 :] = torch.where(live, slots[:, X + 1 :], -1)
    return out


def slots_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows int [T, K]: the permuted row of each (token, k), -1 if dropped -> slots int32 [T, 2K + 1]
    with column ids k, a token's rows ascending (dropped ones last, as -1)."""
    T, K = rows.shape
    rows = rows.to(torch.int64)
    key = torch.where(rows >= 0, rows, torch.iinfo(torch.int64).max)
    sorted_rows, order = key.sort(dim=1, stable=True)
    n = (rows >= 0).sum(1)
    live = torch.arange(K, device=rows.device)[None, :] < n[:, None]
    slots = torch.empty((T, 2 * K + 1), dtype=torch.int32, device=rows.device)
    slots[:, 0] = n.to(torch.int32)
    slots[:, 1 : K + 1] = torch.where(live, sorted_rows, -1).to(torch.int32)
    slots[:, K + 1 :] = torch.where(live, order, -1).to(torch.int32)
    return slots


def index_rows(indices: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """indices int [T, K] (checked >= 0) -> rows int64 [T, K]: (t, k)'s rank in the stable sort of
    the flattened ids (expert-major, then t, then k), -1 from num_out_tokens on."""
    flat = indices.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.shape[0], device=flat.device)
    return torch.where(rank < num_out_tokens, rank, -1).view(indices.shape)


def _first_bad(bad: torch.Tensor, values: torch.Tensor) -> str:
    where = bad.nonzero()[0].tolist()
    return f"{values[tuple(where)].item()} at {where}"


# --------------------------------------------------------------------------------------------
# te_mask_slots: routing_map [T, E] (bool, or an integer/float tensor of 0/1) -> slots [T, 2E + 1]
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("moe_dispatch::te_mask_slots", mutates_args=())
def _te_mask_slots_op(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    mask = routing_map
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(
                f"routing_map must be a 0/1 mask [T, E] with map_type='mask', but it holds "
                f"{_first_bad(bad, mask)}: an index map of expert ids [T, K] needs map_type='index'")
        mask = mask != 0
    E = mask.shape[1]
    slots, stats = custom_ops.make_slots(mask.contiguous(), 1)
    routed = int(stats[:E].sum())
    if num_out_tokens > routed:
        raise ValueError(f"num_out_tokens={num_out_tokens} is larger than the {routed} rows routing_map routes "
                         f"(the extra rows would belong to no token)")
    return drop_rows(slots, num_out_tokens) if num_out_tokens < routed else slots


@_te_mask_slots_op.register_fake
def _(routing_map, num_out_tokens):
    T, E = routing_map.shape
    return routing_map.new_empty((T, 2 * E + 1), dtype=torch.int32)


def mask_slots(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """int32 [T, 2E + 1] slots of a mask map, the rows from num_out_tokens on dropped. Raises
    ValueError when routing_map holds a value other than 0/1, or routes fewer rows than
    num_out_tokens (device data: one host synchronisation on CUDA)."""
    return _te_mask_slots_op(routing_map, num_out_tokens)


# --------------------------------------------------------------------------------------------
# te_index_slots: indices [T, K] of expert ids -> (slots [T, 2K + 1], TE's row_id_map [T * K])
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("moe_dispatch::te_index_slots", mutates_args=())
def _te_index_slots_op(indices: torch.Tensor, num_out_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    if indices.numel():
        bad = (indices < 0) | (indices > INT32_MAX)
        if bool(bad.any()):
            raise ValueError(f"routing_map (map_type='index') must hold expert ids in [0, 2^31), found "
                             f"{_first_bad(bad, indices)}")
    rows = index_rows(indices, num_out_tokens)
    # TE's index row_id_map: entry k * T + t is the row of (t, k), -1 if dropped.
    return slots_from_rows(rows), rows.t().reshape(-1).to(torch.int32)


@_te_index_slots_op.register_fake
def _(indices, num_out_tokens):
    T, K = indices.shape
    return (indices.new_empty((T, 2 * K + 1), dtype=torch.int32),
            indices.new_empty((T * K,), dtype=torch.int32))


def index_slots(indices: torch.Tensor, num_out_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int32 [T, 2K + 1], row_id_map int32 [T * K] in TE's layout) of an index map, the rows
    from num_out_tokens on dropped. Raises ValueError for a negative id (one host
    synchronisation on CUDA)."""
    return _te_index_slots_op(indices, num_out_tokens)


def index_map_slots(row_id_map: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """TE's index row_id_map int [T * K] (entry k * T + t) -> slots int32 [T, 2K + 1]. Values are
    not checked: the kernels skip rows outside [0, N)."""
    return slots_from_rows(row_id_map.view(topk, num_tokens).t())


def shift_rows(slots: torch.Tensor, pad_offsets: torch.Tensor) -> torch.Tensor:
    """slots [T, 2E + 1] of a mask map with each live row moved by pad_offsets[its expert] ([E] int):
    TE's padded layout. Values are not checked: the kernels skip rows outside [0, N)."""
    E = (slots.shape[1] - 1) // 2
    rows, experts = slots[:, 1 : E + 1], slots[:, E + 1 :]
    live = rows >= 0
    shift = pad_offsets.to(device=slots.device, dtype=torch.int64)[experts.clamp(0, E - 1).to(torch.int64)]
    out = slots.clone()
    out[:, 1 : E + 1] = torch.where(live, rows.to(torch.int64) + shift, -1).to(torch.int32)
    return out


# --------------------------------------------------------------------------------------------
# chunk_sort_index: output row i of a chunk sort is input row index[i]
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("moe_dispatch::chunk_sort_index", mutates_args=())
def _chunk_sort_index_op(split_sizes: torch.Tensor, sorted_index: torch.Tensor,
                         num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = split_sizes.to(torch.int64)
    order = sorted_index.to(torch.int64)
    C = sizes.shape[0]
    host_sizes, host_order = sizes.tolist(), order.tolist()  # C entries: the checks' one host read
    if any(s < 0 for s in host_sizes) or sum(host_sizes) > num_rows:
        raise ValueError(f"split_sizes must be >= 0 and sum to at most inp.shape[0] = {num_rows}, got {host_sizes}")
    if sorted(host_order) != list(range(C)):
        raise ValueError(f"sorted_index must be a permutation of range({C}), got {host_order}")
    total = sum(host_sizes)
    in_starts = sizes.cumsum(0) - sizes
    out_sizes = sizes[order]
    out_ends = out_sizes.cumsum(0)
    i = torch.arange(num_rows, device=sizes.device)
    chunk = torch.searchsorted(out_ends, i, right=True).clamp(max=max(C - 1, 0))
    if C:
        index = in_starts[order[chunk]] + (i - (out_ends - out_sizes)[chunk])
        index = torch.where(i < total, index, i)  # rows past the chunks stay in place, as in TE
    else:
        index = i
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(num_rows, device=index.device)
    return index, inverse


@_chunk_sort_index_op.register_fake
def _(split_sizes, sorted_index, num_rows):
    return (split_sizes.new_empty((num_rows,), dtype=torch.int64),
            split_sizes.new_empty((num_rows,), dtype=torch.int64))


def chunk_sort_index(split_sizes: torch.Tensor, sorted_index: torch.Tensor,
                     num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, inverse), int64 [num_rows] each, on split_sizes' device: output row i of the chunk
    sort is input row index[i]; chunk j of the output is input chunk sorted_index[j]; rows past
    sum(split_sizes) stay where they are. split_sizes, sorted_index: int [C]. Raises ValueError
    for negative sizes, sizes summing past num_rows, or sorted_index not a permutation of
    range(C) (on CUDA one host read of the C-entry tables)."""
    return _chunk_sort_index_op(split_sizes, sorted_index, num_rows)
