"""TransformerEngine's MoE permutation functions (TE 2.20 signatures) over this package's kernels.

Code written against ``transformer_engine.pytorch``'s permutation functions moves here by changing
its import line. The functions take TE 2.20's arguments, defaults and return values; the row
copies and weighted sums are this package's registered ops (custom_ops.py), so they run on CPU
(the torch twin) and CUDA (Triton), under autograd and torch.compile. Semantics are TE's except:

- every weighted sum (the unpermute forward, the permute backward) is an fp32 sum in ascending
  expert order, rounded once to the output dtype (fp64 for fp64 probabilities);
- bad input raises ValueError/TypeError naming the argument, before any kernel runs: an integer
  index tensor passed as a mask, a negative expert id, shapes that disagree, a ``num_out_tokens``
  beyond the routed rows. TE 2.20 crashes on some of these (an index tensor read as a mask is an
  illegal memory access that poisons the CUDA context).

Shapes: T tokens, H hidden size, E experts, K experts per token (index maps), N permuted rows.
Rows are expert-major, ascending token within an expert. Float8 rows are plain
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors (TE's Float8Tensor is not needed).
``row_id_map`` has TE's shape and dtype (mask: int32 [T, 2E + 1]; index: int32 [T * K], TE's
exact layout); a mask map's contents are this package's slot layout, made for ``moe_unpermute``.
Host synchronisations: ``moe_permute*`` reads the routing map's row count once (to check
``num_out_tokens``), the chunk sorts read their C-entry tables; ``moe_unpermute`` reads nothing.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch

from . import te_maps
from .custom_ops import gather_rows, permute_rows, unpermute_rows
from .torch_twin import TOKEN_DTYPES

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]

# moe_permute notes the permuted row count on the row_id_map it returns (a host attribute), so
# that moe_unpermute checks inp's rows on the host, with no device read.
_ROWS_ATTR = "_moe_dispatch_permuted_rows"


def _check_inp(name: str, inp: torch.Tensor) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {list(inp.shape)}")
    if inp.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got {inp.dtype}")


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_probs(name: str, probs: torch.Tensor, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """probs as the kernels take them: fp32 or fp64 (any other float dtype widens exactly to fp32;
    autograd rounds its gradient back once)."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point() or probs.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a float32, float64, bfloat16 or float16 tensor, got {probs.dtype}")
    if list(probs.shape) != list(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(probs.shape)}")
    if probs.device != device:
        raise ValueError(f"{name} is on {probs.device}, expected {device} like inp")
    return probs if probs.dtype in (torch.float32, torch.float64) else probs.float()


def _check_mask(routing_map: torch.Tensor, inp: torch.Tensor) -> None:
    if not isinstance(routing_map, torch.Tensor):
        raise TypeError(f"routing_map must be a torch.Tensor, got {type(routing_map).__name__}")
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0] or routing_map.shape[1] < 1:
        raise ValueError(f"routing_map must be a mask [T, E] with T = inp.shape[0] = {inp.shape[0]} and E >= 1, "
                         f"got shape {list(routing_map.shape)}")
    if routing_map.device != inp.device:
        raise ValueError(f"routing_map is on {routing_map.device}, expected {inp.device} like inp")
    if routing_map.is_complex():
        raise TypeError(f"routing_map must be a bool or 0/1 tensor, got {routing_map.dtype}")


def _mark_rows(row_id_map: torch.Tensor, rows: int) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        setattr(row_id_map, _ROWS_ATTR, rows)
    return row_id_map


def _permute_mask(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens, probs: Optional[torch.Tensor],
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Mask-map permute: (rows [N, H], permuted probs [N] in probs' dtype or None, slots)."""
    _check_inp("inp", inp)
    _check_mask(routing_map, inp)
    T, E = routing_map.shape
    num_out_tokens = 0 if T == 0 else _check_int("num_out_tokens", num_out_tokens, 0)  # TE ignores it at T = 0
    kernel_probs = None if probs is None else _check_probs("probs", probs, [T, E], inp.device)
    slots = te_maps.mask_slots(routing_map, num_out_tokens)
    out, out_probs = permute_rows(inp, slots, kernel_probs, num_out_tokens, False)
    if probs is None:
        return out, None, _mark_rows(slots, num_out_tokens)
    return out, out_probs.to(probs.dtype), _mark_rows(slots, num_out_tokens)


def _permute_index(inp: torch.Tensor, indices: torch.Tensor, num_out_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inp("inp", inp)
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"routing_map must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"routing_map must be an integer tensor of expert ids [T, K] with map_type='index', got "
                        f"{indices.dtype} (a bool mask [T, E] needs map_type='mask')")
    if indices.dim() != 2 or indices.shape[0] != inp.shape[0]:
        raise ValueError(f"routing_map must be expert ids [T, K] with T = inp.shape[0] = {inp.shape[0]}, "
                         f"got shape {list(indices.shape)}")
    if indices.device != inp.device:
        raise ValueError(f"routing_map is on {indices.device}, expected {inp.device} like inp")
    T, K = indices.shape
    num_out_tokens = _check_int("num_out_tokens", num_out_tokens, 0)
    if num_out_tokens == 0:  # TE: 0 means every routed row
        num_out_tokens = T * K
    if num_out_tokens > T * K:
        raise ValueError(f"num_out_tokens={num_out_tokens} is larger than the T * K = {T * K} rows routing_map routes")
    slots, row_id_map = te_maps.index_slots(indices, num_out_tokens)
    out, _ = permute_rows(inp, slots, None, num_out_tokens, False)
    return out, _mark_rows(row_id_map, num_out_tokens)


def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int, max_token_num: int = -1,
                map_type: str = "mask") -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token to one row per expert it is routed to: (permuted [N, H], row_id_map).

    Args:
        inp: [T, H] float32, float16, bfloat16, float8_e4m3fn or float8_e5m2.
        routing_map: map_type 'mask': [T, E], bool or 0/1 of any dtype (1: routed). map_type
            'index': int [T, K], the expert ids of each token.
        num_out_tokens: N. Below the routed rows it drops the last rows of the expert-major order
            (as TE's index map and the PyTorch reference do); above them is a ValueError. Index
            map: 0 means T * K. Ignored when T = 0 (TE's empty-input path).
        max_token_num: TE's workspace hint for the index map; checked, otherwise unused.
        map_type: 'mask' or 'index'.

    Returns:
        permuted [N, H] in inp.dtype (bitwise copies of inp's rows); row_id_map for moe_unpermute
        (mask: int32 [T, 2E + 1]; index: int32 [T * K], TE's layout: entry k * T + t is the row of
        token t's k-th expert, -1 if dropped).
    """
    _check_int("max_token_num", max_token_num, -1)
    if map_type == "mask":
        out, _, row_id_map = _permute_mask(inp, routing_map, num_out_tokens, None)
        return out, row_id_map
    if map_type == "index":
        return _permute_index(inp, routing_map, num_out_tokens)
    raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_permute`` of a mask map that also permutes probs [T, E] (any float dtype):
    (permuted [N, H], permuted_probs [N] in probs.dtype, row_id_map int32 [T, 2E + 1]).

    One difference from TE: a routed token whose probability is exactly 0 keeps its row here;
    TE's kernel writes zeros there (for Megatron's routing-map padding), which TE's tests do
    not check and its backward does not follow.
    """
    out, permuted_probs, row_id_map = _permute_mask(inp, routing_map, num_out_tokens, probs)
    return out, permuted_probs, row_id_map


def moe_permute_and_pad_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, tokens_per_expert: torch.Tensor,
    align_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``moe_permute_with_probs`` with each expert's block of rows padded to a multiple of
    align_size with zero rows (zero probs).

    Args:
        tokens_per_expert: int [E], the routed rows of each expert (must equal routing_map's
            column sums: ValueError otherwise).
        align_size: int >= 1.

    Returns:
        (permuted [N_pad, H], permuted_probs [N_pad], row_id_map (unpadded, as TE's),
        pad_offsets int64 [E] (the padding before each expert's block; None when no expert needs
        any), target_tokens_per_expert int64 [E] (the padded block sizes)). Pass pad_offsets to
        moe_unpermute with the padded rows.
    """
    _check_inp("inp", inp)
    _check_mask(routing_map, inp)
    T, E = routing_map.shape
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise ValueError(f"tokens_per_expert must be a tensor [E] = [{E}], got {type(tokens_per_expert).__name__}")
    if list(tokens_per_expert.shape) != [E] or tokens_per_expert.is_floating_point():
        raise ValueError(f"tokens_per_expert must be an int tensor [E] = [{E}], got {tokens_per_expert.dtype} "
                         f"{list(tokens_per_expert.shape)}")
    align_size = _check_int("align_size", align_size, 1)
    counts = tokens_per_expert.to(device=inp.device, dtype=torch.int64)
    routed = (routing_map != 0).sum(0)
    if not torch.equal(counts, routed):  # a host read; TE's own .item() below reads the device too
        raise ValueError(f"tokens_per_expert {counts.tolist()} must equal routing_map's routed rows per expert "
                         f"{routed.tolist()}")
    target = (counts + align_size - 1) // align_size * align_size
    pad = target - counts
    pad_offsets = None if not bool(pad.any()) else pad.cumsum(0) - pad
    num_routed, num_padded = int(counts.sum()), int(target.sum())
    kernel_probs = _check_probs("probs", probs, [T, E], inp.device)
    slots = te_maps.mask_slots(routing_map, num_routed)
    write_slots = slots if pad_offsets is None else te_maps.shift_rows(slots, pad_offsets)
    out, out_probs = permute_rows(inp, write_slots, kernel_probs, num_padded, pad_offsets is not None)
    row_id_map = _mark_rows(slots, num_routed)
    return out, out_probs.to(probs.dtype), row_id_map, pad_offsets, target


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    restore_shape: Optional[Sequence[int]] = None,
    map_type: str = "mask",
    probs: Optional[torch.Tensor] = None,
    pad_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sum each token's permuted rows back into one, weighted by merging_probs when given.

    out[t] = sum over t's rows r, ascending expert, of (merging_probs[t, column] or 1) * inp[r],
    an fp32 sum (fp64 for fp64 probs) rounded once to inp.dtype.

    Args:
        inp: permuted rows [N, H] (any dtype of moe_permute).
        row_id_map: from moe_permute / moe_permute_with_probs / moe_permute_and_pad_with_probs,
            of the same map_type.
        merging_probs: mask map [T, E], index map [T, K], any float dtype; None (or an empty
            tensor, TE's old default) sums unweighted. An index map without probs is top-1:
            row_id_map's T * K entries are the tokens (TE's rule).
        restore_shape: the output's shape, T * H elements with H last; default [T, H]. (TE's
            default, inp.shape, only works where N = T.)
        map_type: 'mask' or 'index', as given to moe_permute.
        probs: the former name of merging_probs (deprecated, as in TE).
        pad_offsets: int [E] from moe_permute_and_pad_with_probs, when inp holds its padded rows.

    Returns:
        [T, H] (or restore_shape) in inp.dtype. Dropped rows contribute nothing.
    """
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("both merging_probs and probs are given; probs is the deprecated name of merging_probs")
        warnings.warn("probs kwarg is deprecated. Use merging_probs kwarg instead.")
        merging_probs = probs
    if isinstance(merging_probs, torch.Tensor) and merging_probs.numel() == 0 and merging_probs.dim() == 1:
        merging_probs = None  # TE 1.x's default, an empty tensor: no weighting
    _check_inp("inp", inp)
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dtype != torch.int32:
        got = row_id_map.dtype if isinstance(row_id_map, torch.Tensor) else type(row_id_map).__name__
        raise TypeError(f"row_id_map must be the int32 tensor moe_permute returned, got {got}")
    if row_id_map.device != inp.device:
        raise ValueError(f"row_id_map is on {row_id_map.device}, expected {inp.device} like inp")
    H = inp.shape[1]
    if map_type == "mask":
        if row_id_map.dim() != 2 or row_id_map.shape[1] < 3 or row_id_map.shape[1] % 2 != 1:
            raise ValueError(f"row_id_map must be a mask map's int32 [T, 2E + 1] with map_type='mask', got shape "
                             f"{list(row_id_map.shape)} (an index map's [T * K] needs map_type='index')")
        T, X = row_id_map.shape[0], (row_id_map.shape[1] - 1) // 2
        slots = row_id_map
        if pad_offsets is not None:
            if not isinstance(pad_offsets, torch.Tensor) or list(pad_offsets.shape) != [X] \
                    or pad_offsets.is_floating_point():
                got = (f"{pad_offsets.dtype} {list(pad_offsets.shape)}" if isinstance(pad_offsets, torch.Tensor)
                       else type(pad_offsets).__name__)
                raise ValueError(f"pad_offsets must be an int tensor [E] = [{X}], got {got}")
            slots = te_maps.shift_rows(row_id_map, pad_offsets)
        probs_shape = [T, X]
    elif map_type == "index":
        if row_id_map.dim() != 1:
            raise ValueError(f"row_id_map must be an index map's int32 [T * K] with map_type='index', got shape "
                             f"{list(row_id_map.shape)} (a mask map's [T, 2E + 1] needs map_type='mask')")
        if pad_offsets is not None:
            raise ValueError("pad_offsets applies to mask maps only (map_type='mask')")
        if merging_probs is not None:
            if merging_probs.dim() != 2 or merging_probs.shape[0] * merging_probs.shape[1] != row_id_map.shape[0]:
                raise ValueError(f"merging_probs must be [T, K] with T * K = row_id_map.shape[0] = "
                                 f"{row_id_map.shape[0]}, got {list(merging_probs.shape)}")
            T, X = merging_probs.shape
        else:
            T, X = row_id_map.shape[0], 1
        slots = te_maps.index_map_slots(row_id_map, T, X)
        probs_shape = [T, X]
    else:
        raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")
    kernel_probs = None if merging_probs is None else _check_probs("merging_probs", merging_probs, probs_shape,
                                                                   inp.device)
    rows = getattr(row_id_map, _ROWS_ATTR, None) if not torch.compiler.is_compiling() else None
    if rows is not None and pad_offsets is None and inp.shape[0] != rows:
        raise ValueError(f"inp has {inp.shape[0]} rows, but moe_permute made {rows} for this row_id_map")
    if restore_shape is not None:
        shape = [int(d) for d in restore_shape]
        if math.prod(shape) != T * H or not shape or shape[-1] != H:
            raise ValueError(f"restore_shape {shape} must hold T * H = {T} * {H} elements with H last "
                             f"(T from row_id_map)")
    out = unpermute_rows(inp, slots, kernel_probs, True, max(X, 1), None, inp.dtype)
    return out if restore_shape is None else out.reshape(shape)


def _sort_chunks(inp: torch.Tensor, probs: Optional[torch.Tensor], split_sizes, sorted_index):
    _check_inp("inp", inp)
    N = inp.shape[0]
    tables = []
    for name, value in (("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.int64)
        if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D int tensor, got {t.dtype} {list(t.shape)}")
        tables.append(t.to(inp.device))
    if tables[0].shape != tables[1].shape:
        raise ValueError(f"split_sizes and sorted_index must have one entry per chunk, got {tables[0].shape[0]} "
                         f"and {tables[1].shape[0]}")
    kernel_probs = None
    if probs is not None:
        kernel_probs = _check_probs("probs", probs, [N], inp.device)
    index, inverse = te_maps.chunk_sort_index(tables[0], tables[1], N)
    out = gather_rows(inp, index, inverse)
    if probs is None:
        return out, None
    return out, gather_rows(kernel_probs[:, None], index, inverse)[:, 0].to(probs.dtype)


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor) -> torch.Tensor:
    """Cut inp [N, H] into chunks of split_sizes [C] rows and lay them out in the order
    sorted_index [C] gives (output chunk j is input chunk sorted_index[j]); rows past
    sum(split_sizes) stay in place. A pure permutation of rows, exact; its backward the inverse."""
    return _sort_chunks(inp, None, split_sizes, sorted_index)[0]


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_sort_chunks_by_index`` that moves probs [N] (any float dtype) with the rows:
    (output [N, H], permuted_probs [N])."""
    out, out_probs = _sort_chunks(inp, probs, split_sizes, sorted_index)
    return out, out_probs
